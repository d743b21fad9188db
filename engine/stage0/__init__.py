"""Stage0 duplex engine: session-long slot KV, continuous batching, fenced units (model.md §3, §7)."""

from engine.stage0.config import DecodeRules, SpecialIds, Stage0Config, TextTokenizer
from engine.stage0.engine import Stage0Engine
from engine.stage0.frontend import UnitFrontEnd
from engine.stage0.sampling import SamplingParams
from engine.stage0.types import (
                                 BadAudioError,
                                 BadFrameError,
                                 BadSamplingError,
                                 CapacityError,
                                 Event,
                                 Fence,
                                 FrontEndError,
                                 InvalidFenceError,
                                 SessionClosedError,
                                 SessionExistsError,
                                 Stage0Error,
                                 StaleFenceError,
                                 TokenEvent,
                                 TooManyFramesError,
                                 UnitDone,
                                 UnitMetrics,
                                 UnknownSessionError,
)

__all__ = [
    "BadAudioError", "BadFrameError", "BadSamplingError", "CapacityError", "DecodeRules", "Event", "Fence", "FrontEndError",
    "InvalidFenceError", "SamplingParams", "SessionClosedError", "SessionExistsError", "SpecialIds", "Stage0Config", "Stage0Engine",
    "Stage0Error", "StaleFenceError", "TextTokenizer", "TokenEvent", "TooManyFramesError", "UnitDone",
    "UnitFrontEnd", "UnitMetrics", "UnknownSessionError",
]
