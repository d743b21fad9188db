"""The scale-out deployments are well-formed and wired the way the gateways route (issue 20).

deploy/k8s/*.yaml against the Kubernetes API schemas (kubernetes-validate, pinned; its schemas ship inside the
wheel, no network), and the `scaleout` profile of docker-compose.yml through Debian's docker-compose.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.runtime.replicas import ReplicaEndpoint
from gateway.settings import GatewaySettings
from tests.deploy.compose import COMPOSE_FILE, REPO

K8S_DIR = REPO / "deploy" / "k8s"
K8S_VERSION = "1.37.0"
NGINX_CONF = REPO / "deploy" / "nginx" / "scaleout.conf"
GPU = "nvidia.com/gpu"


def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(K8S_DIR.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in k8s_docs() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def test_every_manifest_passes_the_kubernetes_schema_strictly() -> None:
    docs = k8s_docs()
    assert {doc["kind"] for _, doc in docs} >= {"StatefulSet", "Deployment", "Service", "ConfigMap"}
    for _, doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError, naming the field
    broken = copy.deepcopy(k8s("StatefulSet", "duplex-triton"))
    container(broken)["readinessProbe"]["httpGet"]["path"] = 8000  # a probe path must be a string
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_each_triton_pod_has_a_gpu_and_every_pod_a_readiness_probe() -> None:
    triton = container(k8s("StatefulSet", "duplex-triton"))
    assert triton["resources"]["limits"][GPU] == 1 and triton["resources"]["requests"][GPU] == 1
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    gateway = container(k8s("Deployment", "duplex-gateway"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert GPU not in gateway["resources"].get("limits", {})


def test_the_gateways_list_every_triton_pod_and_their_settings_validate() -> None:
    sts = k8s("StatefulSet", "duplex-triton")
    env = dict(k8s("ConfigMap", "duplex-gateway")["data"])
    specs = env["DUPLEX_TRITON_REPLICAS"].split(",")
    pods = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}" for i in range(sts["spec"]["replicas"])]
    assert [ReplicaEndpoint.parse(s).grpc for s in specs] == [f"{pod}:8001" for pod in pods]
    assert [ReplicaEndpoint.parse(s).metrics_url for s in specs] == [f"http://{pod}:8002/metrics" for pod in pods]
    assert k8s("Service", "duplex-triton")["spec"]["clusterIP"] == "None"  # per-pod DNS names
    redis = k8s("Service", "duplex-redis")
    assert env["DUPLEX_REDIS_URL"] == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
    names = [e["name"] for e in container(k8s("Deployment", "duplex-gateway"))["env"]]
    assert "DUPLEX_ADVERTISE_ADDR" in names and names.index("POD_IP") < names.index("DUPLEX_ADVERTISE_ADDR")
    GatewaySettings.from_env({**env, "DUPLEX_ADVERTISE_ADDR": "10.0.0.7:8000"})


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="Debian's docker-compose is not installed (apt-get install -y docker-compose); CI installs it")
def test_compose_scaleout_profile_resolves_and_is_wired() -> None:
    done = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "--profile", "scaleout", "config"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    for name in ("gateway-a", "gateway-b"):
        env = services[name]["environment"]
        specs = [ReplicaEndpoint.parse(s) for s in env["DUPLEX_TRITON_REPLICAS"].split(",")]
        assert [s.grpc for s in specs] == ["triton-a:8001", "triton-b:8001"]
        assert env["DUPLEX_ADVERTISE_ADDR"] == f"{name}:8000" and env["DUPLEX_REDIS_URL"].startswith("redis://redis:")
        GatewaySettings.from_env({k: str(v) for k, v in env.items()})
        assert set(services[name]["depends_on"]) == {"triton-a", "triton-b", "redis"}
        assert not services[name].get("ports")  # only the load balancer is published
    gpus = [services[t]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for t in ("triton-a",
                                                                                                      "triton-b")]
    assert gpus[0] != gpus[1]
    assert set(services["lb"]["depends_on"]) == {"gateway-a", "gateway-b"}
    conf = NGINX_CONF.read_text()
    assert "server gateway-a:8000" in conf and "server gateway-b:8000" in conf
    assert "proxy_set_header Upgrade $http_upgrade" in conf and "proxy_http_version 1.1" in conf
