"""Typed errors of the Token2Wav engine (engine/stage1/token2wav_engine.py re-exports them)."""

from __future__ import annotations


class Token2WavError(Exception):
    """Base of every Token2Wav engine error; raising one changes no session's state."""


class UnknownSessionError(Token2WavError, KeyError):
    pass


class UnknownVoiceError(Token2WavError, KeyError):
    pass


class SessionExistsError(Token2WavError):
    pass


class StaleFenceError(Token2WavError):
    """Incarnation differs, or the epoch is older than the session's (protocol.md F-1…F-4)."""


class CodeRangeError(Token2WavError, ValueError):
    """A speech code is outside [0, vocab_size)."""


class CapacityError(Token2WavError):
    """No free cache slot, or a voice prompt longer than the pool allows."""


class UnitPartError(Token2WavError, ValueError):
    """A unit sent in parts out of order: a second head, a head that ends a turn, another unit while a head
    waits for its rest, or a `part` other than "head" / "rest"."""
