"""A stage process reads only its own tensors from the shards (issue 15, "own weights only").

The tiny checkpoint is sharded (thinker text/audio in shard 1, the rest in shard 2, with the index
file), so each stage's reads cross shards the way the real 4-shard checkpoint's do. Every tensor the
loader takes out of a shard is counted by wrapping `safe_open`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import ShardIndex, check_keys, load_checkpoint
from engine.loader import checkpoint as checkpoint_mod
from engine.loader import shards as shards_mod
from engine.loader.checkpoint import THINKER_COMPONENTS, TTS_COMPONENTS

INDEX = "model.safetensors.index.json"


class _CountingOpen:
    """`safe_open` that records every `get_tensor` key."""

    def __init__(self, real: Any, reads: Counter[str]) -> None:
        self.real, self.reads = real, reads

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.real(*args, **kwargs)
        reads = self.reads

        class _Handle:
            def __enter__(self) -> Any:
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc: Any) -> Any:
                return handle.__exit__(*exc)

            def keys(self) -> Any:
                return self.inner.keys()

            def get_slice(self, key: str) -> Any:
                return self.inner.get_slice(key)  # header only: shape and dtype, no data

            def get_tensor(self, key: str) -> torch.Tensor:
                reads[key] += 1
                return self.inner.get_tensor(key)

        return _Handle()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    counter: Counter[str] = Counter()
    monkeypatch.setattr(shards_mod, "safe_open", _CountingOpen(shards_mod.safe_open, counter))
    return counter


def _loadable(ckpt: Path, prefixes: tuple[str, ...]) -> set[str]:
    """The file's keys of these components that a load keeps (optional keys of model.md §8.5 dropped)."""
    cfg = ModelConfig.from_file(ckpt / "config.json", with_vision=False)
    wanted, _ = check_keys(cfg, ShardIndex.from_dir(ckpt))
    return {k for k in wanted if k.split(".", 1)[0] in prefixes}


def test_tiny_checkpoint_is_sharded(tiny_ckpt: Path) -> None:
    owner = json.loads((tiny_ckpt / INDEX).read_text())["weight_map"]
    assert len(set(owner.values())) >= 2


def test_tts_process_reads_only_tts_tensors(tiny_ckpt: Path, reads: Counter[str]) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False,
                         components=TTS_COMPONENTS)
    assert set(reads) == _loadable(tiny_ckpt, TTS_COMPONENTS)
    assert all(n == 1 for n in reads.values())  # each tensor read once
    assert set(ck.model.components()) == {"tts"}
    assert ck.model.llm is None and ck.model.apm is None
    assert ck.model.tts.inv_freq.device.type == "cpu" and ck.model.tts.inv_freq.dtype == torch.float32


def test_thinker_process_reads_no_tts_tensor(tiny_ckpt: Path, reads: Counter[str]) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False,
                         components=THINKER_COMPONENTS)
    assert set(reads) == _loadable(tiny_ckpt, ("llm", "apm", "audio_projection_layer"))
    assert not any(k.startswith(("tts.", "vpm.", "resampler.")) for k in reads)
    assert ck.model.tts is None and ck.model.llm is not None
    # the kept modules are the same as from a whole-checkpoint load
    full = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False)
    for name, p in ck.model.llm.state_dict().items():
        assert torch.equal(p, full.model.llm.state_dict()[name]), name


def test_token2wav_process_reads_no_model_tensor(tiny_ckpt: Path, reads: Counter[str]) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, components=())
    assert not reads  # the Token2Wav assets are separate files; no shard tensor is read
    assert ck.model.components() == {} and ck.token2wav is not None


def test_dropped_components_are_never_materialised(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = checkpoint_mod.materialize_

    def spy(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        built.append(type(module).__name__)
        real(module, *args, **kwargs)

    monkeypatch.setattr(checkpoint_mod, "materialize_", spy)
    load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False,
                    components=TTS_COMPONENTS)
    assert built == ["TTSModel"]
    built.clear()
    load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False, dummy=True,
                    components=TTS_COMPONENTS)
    assert built == ["TTSModel"]


def test_unknown_component_is_refused(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="unknown checkpoint components"):
        load_checkpoint(tiny_ckpt, with_token2wav=False, components=("llm", "decoder"))
