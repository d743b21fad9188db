"""`ConfigContext`: the deployment facts session-config validation needs (protocol.md §2.2-§2.6).

Its own module because both the field checkers (validate.py) and the config snapshot (config.py) read it
and config.py imports validate.py (issue 19: no import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConfigContext:
    """Deployment facts the validator needs (from GatewaySettings) plus the route defaults."""
    served_model: str
    model_aliases: tuple[str, ...]
    voices: tuple[str, ...]
    default_voice_available: bool
    idle_ttl_s: float | None
    force_listen_count: int
    default_input_rate_hz: int
    default_output_format: str
    # An audio response's transcript leaves as it is generated (Realtime: targets.md P13), or only inside its
    # audio pairs (native: one event per pair carries both halves, protocol.md §3.3).
    text_ahead_of_audio: bool = True

    def resolve_model(self, name: str) -> str | None:
        return self.served_model if name == self.served_model or name in self.model_aliases else None
