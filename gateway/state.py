"""Process-wide gateway state held by the app: settings, runtime, registry, admission, leases, auth, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gateway.admission import Admission, AdmissionConfig
from gateway.auth import AuthConfig, Authenticator
from gateway.capabilities import capabilities
from gateway.leases import LeaseConfig, LeaseManager, Reaper
from gateway.observability import GatewayMetrics
from gateway.protocol.config import ConfigContext
from gateway.protocol.profiles import Profile
from gateway.registry import SessionRegistry
from gateway.runtime.base import Readiness, Runtime
from gateway.settings import GatewaySettings
from gateway.ws.messages import Message

if TYPE_CHECKING:
    from gateway.directory.replica import HostFactory, ReplicatedHost
    from gateway.directory.store import SessionDirectory
    from gateway.vad.batcher import VadBatcher

REALTIME_INPUT_RATE_HZ = 24000
NATIVE_INPUT_RATE_HZ = 16000


class HostedSession(Protocol):
    """A session this gateway hosts (`gateway.ws.live.LiveSession`) as process-level code sees it: a mailbox.
    Named here so that this module need not import the ws layer that registers sessions in it."""

    def post(self, msg: Message) -> None: ...


class GatewayState:
    def __init__(self, settings: GatewaySettings, runtime: Runtime) -> None:
        s = self.settings = settings
        self.runtime = runtime
        self.registry = SessionRegistry(s.session_tombstone_ttl_s)
        self.capabilities = capabilities(s)
        self.metrics = GatewayMetrics(s.max_sessions)
        self.admission = Admission(AdmissionConfig(s.max_sessions, cleanup_timeout_s=s.close_ack_timeout_s,
                                                   retry_base_s=min(s.cleanup_retry_base_s, s.reaper_interval_s),
                                                   retry_max_s=s.reaper_interval_s),
                                   on_change=self.metrics.set_session_counts)
        self.leases = LeaseManager(LeaseConfig(s.idle_ttl_s, s.disconnect_grace_s, s.reaper_interval_s))
        self.auth = Authenticator(AuthConfig.build(s.bind_host, s.api_keys, s.allowed_origins, s.auth,
                                                   s.allowed_hosts))
        self.vad: VadBatcher | None = None  # one shared model and its batcher, loaded by the first server_vad session
        self.sessions: dict[str, HostedSession] = {}  # open, detached or closing: the resume lookup
        self.tasks: set[asyncio.Task[None]] = set()  # session hosts; they outlive their sockets
        self.reaper: Reaper | None = None
        self.directory: SessionDirectory | None = None  # several gateways: where a session lives (gateway/directory)
        # several gateways: what copies a hosted session to Redis, and what hosts one adopted from a dead gateway
        self.replicate: Callable[[ReplicatedHost], None] | None = None
        self.host_factory: HostFactory | None = None
        self.draining = False
        self.warm = False  # set once the runtime has reported ready (warm-up done)
        self._ready_cache: tuple[float, Readiness] | None = None

    def config_context(self, profile: Profile) -> ConfigContext:
        native = profile is Profile.NATIVE
        s = self.settings
        return ConfigContext(served_model=s.model_name, model_aliases=s.model_aliases, voices=s.voices,
                             default_voice_available=s.default_voice_available, idle_ttl_s=s.idle_ttl_s,
                             force_listen_count=s.force_listen_count,
                             default_input_rate_hz=NATIVE_INPUT_RATE_HZ if native else REALTIME_INPUT_RATE_HZ,
                             default_output_format="wav" if native else "pcm16", text_ahead_of_audio=not native)

    def vad_batcher(self) -> VadBatcher:
        """The one Silero model of the process (≈ 2 MB) and the batcher that runs every session's windows on it,
        loaded by the first server_vad session."""
        if self.vad is None:
            from gateway.vad.batcher import VadBatcher  # noqa: PLC0415 - onnxruntime only when VAD is used
            from gateway.vad.model import SileroVad  # noqa: PLC0415

            self.vad = VadBatcher(SileroVad())
        return self.vad

    def hosted(self, host: ReplicatedHost) -> None:
        """A session is hosted here from now on (opened, or adopted): with several gateways, its copy in Redis."""
        if self.replicate is not None:
            self.replicate(host)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def readiness(self) -> tuple[bool, dict[str, Any], list[str]]:
        """§11.3 checks, cached for `ready_cache_s`."""
        now = time.monotonic()
        if self._ready_cache is None or now - self._ready_cache[0] > self.settings.ready_cache_s:
            try:
                async with asyncio.timeout(self.settings.ready_probe_timeout_s):
                    r = await self.runtime.readiness()
            except Exception as exc:  # noqa: BLE001 - any probe failure means "not ready", with the reason
                r = Readiness(False, False, {}, (f"runtime probe failed: {exc.__class__.__name__}",))
            self._ready_cache = (now, r)
        r = self._ready_cache[1]
        self.warm = self.warm or r.all_ready  # the runtime reports ready only after its warm-up
        checks = {"triton_live": r.live, "triton_ready": r.ready, "models": dict(r.models),
                  "warmup": self.warm, "draining": self.draining}
        reasons = list(r.reasons)
        if not r.all_ready:
            reasons.append("runtime not ready")
        if self.draining:
            reasons.append("gateway draining")
        return (r.all_ready and not self.draining), checks, reasons
