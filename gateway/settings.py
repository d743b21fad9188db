"""The gateway's one typed settings object (env prefix DUPLEX_). Nothing else reads the environment."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ENV_PREFIX = "DUPLEX_"
MiB = 1024 * 1024


class GatewaySettings(BaseModel):
    """Deploy-profile values (protocol.md §5.1 limits are server-owned; every value must be > 0)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    triton_url: str = "localhost:8001"
    # Scale-out (docs/deploy.md): several Triton replicas, each `host:grpc_port[|host:metrics_port]` (metrics port
    # 8002 when left out). Set, it replaces triton_url; each new session goes to the replica with the most room.
    triton_replicas: tuple[str, ...] = ()
    replica_retry_s: float = Field(5.0, gt=0)  # a replica whose probe failed is skipped this long, then probed again
    # Several gateways (docs/deploy.md Scale-out): the shared session directory, e.g. redis://redis:6379/0. Set, it
    # needs advertise_addr, the host:port other gateways reach this one at (a resume they get is relayed here).
    redis_url: str | None = None
    advertise_addr: str | None = None
    directory_lease_s: float = Field(10.0, gt=0)  # a gateway unheard of this long is dead: its sessions are gone
    # every key of a session's copy in Redis expires this long after its owner last wrote or checked it, a backstop
    # for copies nobody sweeps (every gateway died); None: 3 x (directory_lease_s + disconnect_grace_s +
    # resume_replay_ttl_s), 300 s with the defaults (gateway/directory/store.py)
    directory_copy_ttl_s: float | None = Field(None, gt=0)
    # "stages": the gateway chains stage0 -> tts -> token2wav on one stream per session (the served path,
    # gateway/runtime/stages.py); "pipeline": one request per unit to the `triton_model` BLS model.
    triton_mode: Literal["stages", "pipeline"] = "stages"
    triton_model: str = "duplex"
    triton_batch_dim: bool = True  # the pipeline has max_batch_size >= 1 (sequence batching): tensors get [1, ...]
    triton_ready_models: tuple[str, ...] = ("duplex",)
    model_name: str = "openbmb/MiniCPM-o-4_5"
    model_aliases: tuple[str, ...] = ("MiniCPM-o-4_5", "minicpm-o-4.5")
    model_created: int = 1767225600
    voices: tuple[str, ...] = ("default",)
    default_voice_available: bool = True
    force_listen_count: int = Field(3, ge=0)
    # per-session and server limits, names and defaults as protocol.md §5.1
    idle_ttl_s: float | None = Field(300.0, gt=0)
    disconnect_grace_s: float = Field(30.0, gt=0)
    reaper_interval_s: float = Field(5.0, gt=0)
    resume_replay_ttl_s: float = Field(60.0, gt=0)
    resume_replay_max_bytes_per_session: int = Field(8 * MiB, gt=0)
    max_pending_input_bytes_per_session: int = Field(16 * MiB, gt=0)
    max_pending_turns_per_session: int = Field(4, gt=0)
    max_sessions: int = Field(1, gt=0)
    completed_append_cache_size: int = Field(256, gt=0)
    handshake_timeout_s: float = Field(10.0, gt=0)
    close_ack_timeout_s: float = Field(10.0, gt=0)
    session_tombstone_ttl_s: float = Field(600.0, gt=0)
    # WebSocket transport limits (protocol.md §1.5)
    max_frame_bytes: int = Field(15 * MiB, gt=0)
    ws_max_message_bytes: int = Field(16 * MiB, gt=0)
    # DUPLEX_WS_PER_MESSAGE_DEFLATE: accept a client's permessage-deflate offer (uvicorn's default is to accept).
    # Off: the bytes are mostly base64 PCM, which deflate shrinks only to about 0.6 of its size for speech (0.75
    # for noise) at about 1.7 ms of the one event-loop core per second of 24 kHz output audio, 11 % of a core at
    # 64 speaking sessions (bench/RESULTS.md "Stop 63"). On for links where bandwidth costs more than the gateway's CPU.
    ws_per_message_deflate: bool = False
    outbound_max_bytes: int = Field(2 * MiB, gt=0)
    outbound_max_events: int = Field(512, gt=0)
    outbound_reserve_bytes: int = Field(64 * 1024, gt=0)
    outbound_reserve_events: int = Field(8, gt=0)
    # runtime
    runtime_timeout_s: float = Field(10.0, gt=0)
    ready_cache_s: float = Field(1.0, ge=0)
    ready_probe_timeout_s: float = Field(2.0, gt=0)  # a hung Triton must not hang /ready or the handshake
    tick_interval_s: float = Field(0.05, gt=0)
    unit_deadline_grace_s: float = Field(0.25, ge=0)
    # DUPLEX_UNIT_ALIGN_S > 0: after each commit the next unit is cut short on a shared tick of this period, so the
    # sessions' units reach the stages together (gateway/session/units.py); 0 = off. A deploy profile's
    # `unit_align_s` sets it (served A/B: bench/RESULTS.md "Stop 30")
    unit_align_s: float = Field(0.0, ge=0)
    # DUPLEX_UNIT_ALIGN_MIN_SESSIONS > 0: align only while at least this many sessions are live on this gateway
    # (a deploy profile's `unit_align_min_sessions`); 0 = whenever unit_align_s > 0
    unit_align_min_sessions: int = Field(0, ge=0)
    # admission, auth, VAD, web demo
    cleanup_retry_base_s: float = Field(0.5, gt=0)
    bind_host: str = "127.0.0.1"
    api_keys: tuple[str, ...] = ()  # DUPLEX_API_KEYS (comma-separated); any key set makes auth required
    auth: Literal["auto", "required", "off"] = "auto"  # DUPLEX_AUTH, see gateway/auth.py AuthConfig.build
    allowed_origins: tuple[str, ...] = ()  # DUPLEX_ALLOWED_ORIGINS besides the gateway's own; "*" = any
    allowed_hosts: tuple[str, ...] = ()  # DUPLEX_ALLOWED_HOSTS: Host names a key-less gateway answers to (auth.py)
    vad_onset_confirm_ms: int = Field(64, gt=0)
    web_root: str | None = None  # DUPLEX_WEB_ROOT; None = <repo>/clients/web when it exists; "" = off

    @field_validator("triton_ready_models", "triton_replicas", "model_aliases", "voices", "api_keys", "allowed_origins",
                     "allowed_hosts", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(json.loads(v)) if v.startswith("[") else tuple(x for x in v.split(",") if x)
        return v

    @field_validator("triton_replicas")
    @classmethod
    def _replica_specs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from gateway.runtime.replicas import ReplicaEndpoint  # noqa: PLC0415 - the one parser of a replica spec

        for spec in v:
            ReplicaEndpoint.parse(spec)  # ValueError -> a settings validation error naming the spec
        return v

    @model_validator(mode="after")
    def _directory_needs_an_address(self) -> GatewaySettings:
        if self.redis_url and not self.advertise_addr:
            raise ValueError("redis_url needs advertise_addr (DUPLEX_ADVERTISE_ADDR): where other gateways reach this one")
        if self.redis_url and self.triton_mode != "stages":
            raise ValueError("redis_url (several gateways sharing a session directory) needs triton_mode=stages: a dead "
                             "gateway's sessions are adopted and swept through the stage models' sequences, which the "
                             "pipeline mode does not expose (docs/deploy.md, Scale-out)")
        floor = self.directory_lease_s + self.disconnect_grace_s
        if self.directory_copy_ttl_s is not None and self.directory_copy_ttl_s <= floor:
            raise ValueError(f"directory_copy_ttl_s ({self.directory_copy_ttl_s:g}) must exceed directory_lease_s + "
                             f"disconnect_grace_s ({floor:g}): a dead gateway's sessions must stay adoptable that long")
        return self

    def copy_ttl_s(self) -> float:
        """The TTL of every key of a session's copy in Redis (directory_copy_ttl_s, or its default)."""
        if self.directory_copy_ttl_s is not None:
            return self.directory_copy_ttl_s
        from gateway.directory.store import default_copy_ttl_s  # noqa: PLC0415 - settings import nothing at load

        return default_copy_ttl_s(self.directory_lease_s, self.disconnect_grace_s, self.resume_replay_ttl_s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewaySettings:
        env = os.environ if environ is None else environ
        values = {k[len(ENV_PREFIX):].lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX)}
        known = {k: v for k, v in values.items() if k in cls.model_fields}
        for key in ("idle_ttl_s", "redis_url", "advertise_addr", "directory_copy_ttl_s"):
            if known.get(key, "").lower() in ("null", "none"):
                known[key] = None
        return cls.model_validate(known)

    def limits_json(self) -> dict[str, Any]:
        keys = ("idle_ttl_s", "disconnect_grace_s", "reaper_interval_s", "resume_replay_ttl_s",
                "resume_replay_max_bytes_per_session", "max_pending_input_bytes_per_session",
                "max_pending_turns_per_session", "max_sessions", "completed_append_cache_size",
                "handshake_timeout_s", "close_ack_timeout_s", "session_tombstone_ttl_s")
        return {k: getattr(self, k) for k in keys}
