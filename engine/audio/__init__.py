"""Stage0 audio front end: mel, unit framing and per-session streaming encoder state."""

from engine.audio.framing import MelStreamer, MelStreamState, StreamConfig, UnitMel
from engine.audio.frontend import AudioFrontEnd, AudioStreamState
from engine.audio.mel import FloorMode, LogMel, MelConfig

__all__ = ["AudioFrontEnd", "AudioStreamState", "FloorMode", "LogMel", "MelConfig", "MelStreamState",
           "MelStreamer", "StreamConfig", "UnitMel"]
