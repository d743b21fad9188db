"""Checkpoint loading (model.md §8): `load_checkpoint` and its error type."""

from engine.loader.checkpoint import LoadedCheckpoint, load_checkpoint
from engine.loader.shards import CheckpointError, ShardIndex, check_keys

__all__ = ["CheckpointError", "LoadedCheckpoint", "ShardIndex", "check_keys", "load_checkpoint"]
