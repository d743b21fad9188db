"""Helpers shared by the deploy tests: read docker-compose.yml and the Dockerfiles as Compose would."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILES = {"triton": REPO / "deploy" / "Dockerfile.triton", "gateway": REPO / "deploy" / "Dockerfile.gateway"}
PROMETHEUS_FILE = REPO / "deploy" / "prometheus" / "prometheus.yml"

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}: the forms docker-compose 1.29 knows.
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Resolve `${...}` like Compose does (recursively through lists and mappings)."""
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, arg = m["name"], m["op"], m["arg"]
        present = name in env and (env[name] != "" or op not in (":-", ":?"))
        if present:
            return env[name]
        if op in (":?", "?"):
            raise KeyError(f"${{{name}}} is required: {arg}")
        return arg if op in (":-", "-") else ""

    return _VAR.sub(one, value.replace("$$", "\0")).replace("\0", "$")


def service(name: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return interpolate(load_compose()["services"][name], env or {})


def dockerfile_cmd(name: str) -> list[str]:
    """The JSON (exec) form CMD of one of our Dockerfiles."""
    lines = [ln for ln in DOCKERFILES[name].read_text().splitlines() if ln.startswith("CMD ")]
    assert len(lines) == 1, f"{DOCKERFILES[name]} must have exactly one CMD line"
    return json.loads(lines[0][len("CMD "):])


def dockerfile_arg(name: str, arg: str) -> str:
    m = re.search(rf'^ARG {arg}="?([^"\n]*)"?$', DOCKERFILES[name].read_text(), re.M)
    assert m, f"{DOCKERFILES[name]} has no ARG {arg}"
    return m[1]


def dockerfile_from(name: str) -> list[str]:
    return re.findall(r"^FROM\s+(\S+)", DOCKERFILES[name].read_text(), re.M)


def flag(argv: list[str], name: str) -> str | None:
    """Value of `--name VALUE` or `--name=VALUE` in an argv list."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
