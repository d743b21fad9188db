"""Process-wide gateway state held by the app: settings, runtime, registry, readiness, counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.capabilities import capabilities
from gateway.protocol.config import ConfigContext
from gateway.protocol.profiles import Profile
from gateway.registry import SessionRegistry
from gateway.runtime.base import Readiness, Runtime
from gateway.settings import GatewaySettings

REALTIME_INPUT_RATE_HZ = 24000
NATIVE_INPUT_RATE_HZ = 16000


@dataclass
class Counters:
    """Process counters behind /metrics (labels never carry client-controlled strings, §10.4)."""
    ignored_binary_frames: int = 0
    stale_dropped: dict[str, int] = field(default_factory=dict)
    admission_rejected: dict[str, int] = field(default_factory=dict)
    sessions_ended: dict[str, int] = field(default_factory=dict)


class GatewayState:
    def __init__(self, settings: GatewaySettings, runtime: Runtime) -> None:
        self.settings = settings
        self.runtime = runtime
        self.registry = SessionRegistry(settings.max_sessions, settings.session_tombstone_ttl_s)
        self.capabilities = capabilities(settings)
        self.counters = Counters()
        self.draining = False
        self._ready_cache: tuple[float, Readiness] | None = None

    def config_context(self, profile: Profile) -> ConfigContext:
        native = profile is Profile.NATIVE
        s = self.settings
        return ConfigContext(served_model=s.model_name, model_aliases=s.model_aliases, voices=s.voices,
                             default_voice_available=s.default_voice_available, idle_ttl_s=s.idle_ttl_s,
                             force_listen_count=s.force_listen_count,
                             default_input_rate_hz=NATIVE_INPUT_RATE_HZ if native else REALTIME_INPUT_RATE_HZ,
                             default_output_format="wav" if native else "pcm16")

    async def readiness(self) -> tuple[bool, dict[str, Any], list[str]]:
        """§11.3 checks, cached for `ready_cache_s`."""
        now = time.monotonic()
        if self._ready_cache is None or now - self._ready_cache[0] > self.settings.ready_cache_s:
            try:
                r = await self.runtime.readiness()
            except Exception as exc:  # noqa: BLE001 - any probe failure means "not ready", with the reason
                r = Readiness(False, False, {}, (f"runtime probe failed: {exc.__class__.__name__}",))
            self._ready_cache = (now, r)
        r = self._ready_cache[1]
        checks = {"triton_live": r.live, "triton_ready": r.ready, "models": dict(r.models),
                  "warmup": True, "draining": self.draining}
        reasons = list(r.reasons)
        if not r.all_ready:
            reasons.append("runtime not ready")
        if self.draining:
            reasons.append("gateway draining")
        return (r.all_ready and not self.draining), checks, reasons
