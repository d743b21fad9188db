"""Connection parameters (protocol.md §1.2) -> profile, autostart, model; handshake errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.protocol.errors import ProtocolError
from gateway.protocol.profiles import Profile

_TRUE = {"1", "true", "on"}
_FALSE = {"0", "false", "off"}
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
KNOWN_SUBPROTOCOLS = ("realtime", BETA_SUBPROTOCOL)


@dataclass(frozen=True, slots=True)
class ConnectionParams:
    route: str  # "/v1/realtime" | "/v1/duplex"
    profile: Profile
    autostart: bool
    resume: bool
    model: str | None
    subprotocol: str | None


def _flag(query: Mapping[str, str], name: str, default: bool) -> bool:
    raw = query.get(name)
    if raw is None:
        return default
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ProtocolError("bad_event", f"{name} must be 0/1", param=name)


def parse_params(route: str, query: Mapping[str, str], headers: Mapping[str, str],
                 subprotocols: list[str]) -> ConnectionParams:
    """Validate the route's query and headers and select the profile (H1). Raises ProtocolError (handshake
    effect) for invalid parameters."""
    duplex = query.get("duplex")
    if duplex is not None:
        low = duplex.lower()
        if low in _FALSE:
            raise ProtocolError("unsupported", "non-duplex Realtime is not served", param="duplex")
        if low not in _TRUE:
            raise ProtocolError("bad_event", "duplex must be 1/true/on", param="duplex")
    for legacy in ("native_duplex", "minicpmo45_native_duplex"):
        if query.get(legacy, "").lower() in _FALSE:
            raise ProtocolError("unsupported", "model-native duplex cannot be disabled", param=legacy)
    native = route == "/v1/duplex"
    resume = _flag(query, "resume", False)
    autostart = _flag(query, "autostart", not native) and not resume
    beta = (not native) and (_flag(query, "beta", False)
                             or headers.get("openai-beta", "").strip().lower() == "realtime=v1"
                             or BETA_SUBPROTOCOL in subprotocols)
    profile = Profile.NATIVE if native else (Profile.BETA if beta else Profile.GA)
    echo = next((p for p in subprotocols if p in KNOWN_SUBPROTOCOLS), None)
    return ConnectionParams(route, profile, autostart, resume, query.get("model"), echo)
