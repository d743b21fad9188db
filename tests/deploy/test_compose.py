"""docker-compose.yml: valid for Debian's docker-compose, and wired the way `duplex serve` runs (issue 9)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from typing import Any

import pytest
import yaml

from tests.deploy.compose import (
    COMPOSE_FILE,
    PROMETHEUS_FILE,
    REPO,
    dockerfile_cmd,
    dockerfile_from,
    flag,
    load_compose,
    service,
)

TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51 = tritonclient 2.51.0, pytriton 0.7.0
PROFILE_MOUNT = "/opt/duplex/deploy/profiles"


def _compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEX_", "COMPOSE_"))}
    return {**env, **extra}


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="Debian's docker-compose is not installed (apt-get install -y docker-compose); CI installs it")
def test_docker_compose_config_accepts_the_file() -> None:
    for env in (_compose_env(), _compose_env(DUPLEX_PROFILE="default", DUPLEX_API_KEYS="k", DUPLEX_GPU="1")):
        done = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="Debian's docker-compose is not installed (apt-get install -y docker-compose); CI installs it")
def test_our_interpolation_agrees_with_docker_compose() -> None:
    env = _compose_env(DUPLEX_PROFILE="default")
    done = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    for name in ("triton", "gateway"):
        assert resolved[name]["command"] == service(name, {"DUPLEX_PROFILE": "default"})["command"]


def test_services_and_profiles() -> None:
    services = load_compose()["services"]
    scaleout = {"triton-a", "triton-b", "gateway-a", "gateway-b", "redis", "lb"}  # tests/scaleout/test_manifests.py
    assert set(services) == {"triton", "gateway", "prometheus"} | scaleout
    assert services["prometheus"].get("profiles") == ["prometheus"]
    assert all(services[name].get("profiles") == ["scaleout"] for name in scaleout)
    assert "profiles" not in services["triton"] and "profiles" not in services["gateway"]


def test_images_are_pinned() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, svc in load_compose()["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "$" not in tag, f"{name}: image {image!r} is not pinned"
        if "build" in svc:
            assert tag == version, f"{name}: our image tag {tag!r} should be the project version {version!r}"
    assert dockerfile_from("triton") == [TRITON_IMAGE]
    for ref in dockerfile_from("gateway"):
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", ref), f"gateway base {ref!r} needs a full version tag"


def test_triton_reserves_a_gpu_and_mounts_the_checkpoint() -> None:
    triton = service("triton")
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    target = flag(triton["command"], "--checkpoint")
    mounts = {v.split(":")[1]: v for v in triton["volumes"]}
    assert target in mounts and mounts[target].endswith(":ro"), "the checkpoint is mounted read-only where --checkpoint points"


def test_healthchecks_and_startup_order() -> None:
    triton, gateway = service("triton"), service("gateway")
    http_port = flag(triton["command"], "--triton-http-port")
    assert triton["healthcheck"]["test"][0] == "CMD"
    assert f"127.0.0.1:{http_port}/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert f"127.0.0.1:{flag(gateway['command'], '--port')}/ready" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"]["triton"]["condition"] == "service_healthy"


def test_gateway_environment_names_real_settings_with_their_defaults() -> None:
    from gateway.settings import ENV_PREFIX, GatewaySettings

    env = service("gateway")["environment"]
    assert {"DUPLEX_API_KEYS", "DUPLEX_AUTH", "DUPLEX_ALLOWED_ORIGINS"} <= set(env)
    defaults = GatewaySettings()
    for key, value in env.items():
        field = key.removeprefix(ENV_PREFIX).lower()
        assert field in GatewaySettings.model_fields, f"{key} is not a gateway setting"
        parsed = GatewaySettings.from_env({key: str(value)})
        assert getattr(parsed, field) == getattr(defaults, field), f"{key} default differs from GatewaySettings"


def test_both_services_read_the_same_profile() -> None:
    triton, gateway = service("triton"), service("gateway")
    profile = flag(triton["command"], "--profile")
    assert profile == flag(gateway["command"], "--profile") and profile.startswith(PROFILE_MOUNT + "/")
    for svc in (triton, gateway):
        assert f"./deploy/profiles:{PROFILE_MOUNT}:ro" in svc["volumes"]
    assert (REPO / "deploy" / "profiles" / profile.rsplit("/", 1)[1]).exists()


def test_prometheus_scrapes_triton_and_gateway() -> None:
    triton, gateway = service("triton"), service("gateway")
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"triton:{flag(triton['command'], '--triton-metrics-port')}",
                       f"gateway:{flag(gateway['command'], '--port')}"}
    mount = next(v for v in service("prometheus")["volumes"] if v.startswith("./deploy/prometheus/"))
    assert (REPO / mount.split(":")[0]).resolve() == PROMETHEUS_FILE


def test_gateway_is_published_on_loopback_by_default() -> None:
    (port,) = service("gateway")["ports"]
    host, host_port, container_port = port.split(":")
    assert host == "127.0.0.1" and container_port == flag(service("gateway")["command"], "--port")
    assert "ports" not in service("triton"), "Triton stays on the compose network"


def test_dockerfile_cmd_is_the_compose_command() -> None:
    for name in ("triton", "gateway"):
        assert dockerfile_cmd(name) == service(name)["command"]


def _serve_options(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run the real `duplex` CLI on argv with `serve` replaced by a recorder; return its ServeOptions."""
    import serve.cli
    import serve.launcher

    seen: list[Any] = []
    monkeypatch.setattr(serve.launcher, "serve", lambda opts: seen.append(opts) or 0)
    assert argv[:2] == ["duplex", "serve"], f"container command must be `duplex serve ...`, got {argv[:2]}"
    try:
        code = serve.cli.main(argv[1:])
    except SystemExit as exc:  # argparse rejected a flag
        pytest.fail(f"`{' '.join(argv)}` is not accepted by serve/cli.py (exit {exc.code}); issue 9 needs "
                    "--only, --triton-host, --triton-{http,grpc,metrics}-port and --triton-url")
    assert code == 0 and len(seen) == 1
    return seen[0]


def test_container_commands_are_duplex_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_cmd, gateway_cmd = service("triton")["command"], service("gateway")["command"]
    t = _serve_options(triton_cmd, monkeypatch)
    g = _serve_options(gateway_cmd, monkeypatch)
    assert t.only == "triton" and g.only == "gateway"
    assert str(t.profile) == str(g.profile) == flag(triton_cmd, "--profile")
    assert str(t.checkpoint) == flag(triton_cmd, "--checkpoint")
    assert t.triton_host == "0.0.0.0", "Triton must listen beyond loopback for the gateway container"
    ports = {"http": t.triton_http_port, "grpc": t.triton_grpc_port, "metrics": t.triton_metrics_port}
    assert {str(p) for p in ports.values()} == set(service("triton")["expose"])
    assert g.triton_url == f"triton:{ports['grpc']}"
    assert (g.host, str(g.port)) == ("0.0.0.0", flag(gateway_cmd, "--port"))
