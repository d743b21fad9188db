"""Model-config parameters of a stage, validated once in `initialize` (frozen, typed)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
MPS_THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class ConfigError(ValueError):
    """A bad model-config parameter: Triton shows it as the model's load error."""


@dataclass(frozen=True)
class StageSettings:
    stage: str
    engine_factory: str  # "module:callable" returning a StageEngine
    checkpoint_dir: str
    device: str
    dtype: str
    max_sessions: int
    kv_window: int
    session_idle_ttl_s: float
    engine_options: str = "{}"  # JSON object of engine-specific options (deploy profile `engine_options`)
    mps_thread_percentage: int = 0  # share of the GPU's SMs under MPS (deploy profile); 0: not capped

    def __post_init__(self) -> None:
        if not 0 <= self.mps_thread_percentage <= 100:
            raise ConfigError(f"parameter mps_thread_percentage must be in 1..100 (0: not capped), got "
                              f"{self.mps_thread_percentage}")
        if self.device.split(":")[0] not in DEVICES:
            raise ConfigError(f"parameter device={self.device!r} must be one of {DEVICES} (optionally cuda:N)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"parameter dtype={self.dtype!r} must be one of {DTYPES}")
        for name in ("max_sessions", "kv_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parameter {name} must be >= 1, got {getattr(self, name)}")
        if self.session_idle_ttl_s <= 0:
            raise ConfigError(f"parameter session_idle_ttl_s must be > 0, got {self.session_idle_ttl_s}")
        if ":" not in self.engine_factory:
            raise ConfigError(f"parameter engine_factory={self.engine_factory!r} must look like 'module:callable'")

    @classmethod
    def from_model_config(cls, model_config: dict[str, Any]) -> StageSettings:
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}

        def need(name: str) -> str:
            if not params.get(name):
                raise ConfigError(f"model {model_config.get('name')!r}: missing parameter {name!r} in config.pbtxt")
            return params[name]

        def number(name: str, kind: Callable[[str], Any]) -> Any:
            try:
                return kind(need(name))
            except ValueError as exc:
                raise ConfigError(f"parameter {name}={params[name]!r} is not a {kind.__name__}") from exc

        return cls(
            stage=need("stage"), engine_factory=need("engine_factory"), checkpoint_dir=params.get("checkpoint_dir", ""),
            device=need("device"), dtype=need("dtype"), max_sessions=number("max_sessions", int),
            kv_window=number("kv_window", int), session_idle_ttl_s=number("session_idle_ttl_s", float),
            engine_options=params.get("engine_options") or "{}",
            mps_thread_percentage=number("mps_thread_percentage", int) if params.get("mps_thread_percentage") else 0,
        )


def cap_mps_threads(settings: StageSettings, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Set this process's MPS share of the GPU's SMs (`mps_thread_percentage`) in its environment; CUDA reads it
    when the process creates its context, so call this before anything touches the GPU. Returns the share set."""
    if not settings.mps_thread_percentage:
        return None
    environ[MPS_THREADS_ENV] = str(settings.mps_thread_percentage)
    return settings.mps_thread_percentage


def session_expiry_s(settings: StageSettings, model_config: dict[str, Any]) -> float:
    """When a stage forgets an idle session: when Triton drops its sequence (`max_sequence_idle_microseconds`),
    not at the gateway's own idle TTL. Expiring at the gateway's TTL raced the gateway's close of that session
    (the close found no session and the gateway kept retrying it)."""
    micros = (model_config.get("sequence_batching") or {}).get("max_sequence_idle_microseconds")
    try:
        return max(settings.session_idle_ttl_s, int(micros) / 1e6) if micros else settings.session_idle_ttl_s
    except (TypeError, ValueError):
        return settings.session_idle_ttl_s


def instance_device(device: str, args: dict[str, Any]) -> str:
    """The device this model instance runs on: Triton places each KIND_GPU instance on a GPU of its
    `instance_group` and passes it as `model_instance_kind` / `model_instance_device_id` in the
    `initialize` args. A bare `cuda` takes that GPU; an explicit `cuda:N` (or `cpu`) is kept as written."""
    if device != "cuda" or str(args.get("model_instance_kind", "")).upper() != "GPU":
        return device
    device_id = str(args.get("model_instance_device_id", ""))
    if not device_id.isdigit():
        raise ConfigError(f"a KIND_GPU instance without a GPU id (model_instance_device_id={device_id!r})")
    return f"cuda:{int(device_id)}"


def load_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"engine_factory {spec!r} cannot be imported: {exc}") from exc
