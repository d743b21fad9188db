"""Derivation of the server-owned `runtime_config` (protocol.md §2.5) sent as CONFIG on open/update."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from gateway.protocol.config import SessionConfig


@dataclass(frozen=True, slots=True)
class RuntimeDefaults:
    """Deploy-profile sampling and per-unit limits; never settable from the wire.

    Every key `derive` sends is applied by some stage or refused with `invalid_runtime_config`
    (model_repository/common/bridges/options.py). Not sent: what the reference duplex loop has no use for
    (`min_speak_tokens_before_chunk_boundary`; talker top-k/top-p, Q14) and what the gateway enforces itself
    (`max_output_tokens`, in gateway/session/response_track.py).
    """
    thinker_top_p: float = 0.8
    thinker_top_k: int = 20
    thinker_repetition_penalty: float = 1.05
    thinker_repetition_window: int = 512
    max_speak_chars_per_unit: int = 28
    turn_eos_length_penalty: float = 1.1
    talker_temperature: float = 0.8
    talker_repetition_penalty: float = 1.05
    talker_codes_per_unit: int = 25


def derive(cfg: SessionConfig, d: RuntimeDefaults) -> dict[str, Any]:
    """Candidate runtime config; equal candidates skip the runtime round trip (§2.7 U4)."""
    return {
        "instructions": cfg.instructions,
        "voice": cfg.voice,
        # the clip as 16 kHz mono PCM16, decoded once at validation (validate.check_ref_audio)
        "ref_audio": base64.b64encode(cfg.ref_audio.pcm16k).decode() if cfg.ref_audio else None,
        "seed": cfg.seed,
        "initial_user_text": cfg.duplex_initial_user_text,
        "text_only": cfg.text_only,
        "temperature": cfg.temperature,
        "top_p": d.thinker_top_p,
        "top_k": d.thinker_top_k,
        "repetition_penalty": d.thinker_repetition_penalty,
        "force_listen_count": cfg.force_listen_count,
        "thinker": {"temperature": cfg.temperature, "top_p": d.thinker_top_p, "top_k": d.thinker_top_k,
                    "repetition_penalty": d.thinker_repetition_penalty,
                    "repetition_window": d.thinker_repetition_window, "max_tokens_per_unit": cfg.max_tokens,
                    "max_speak_chars_per_unit": d.max_speak_chars_per_unit,
                    "turn_eos_length_penalty": d.turn_eos_length_penalty},
        "talker": {"temperature": d.talker_temperature, "repetition_penalty": d.talker_repetition_penalty,
                   "codes_per_unit": d.talker_codes_per_unit},
    }
