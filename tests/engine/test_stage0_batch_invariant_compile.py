"""Stage0Config.batch_invariant reaches torch.compile as unsplit reductions (issue 16). Whether it makes the
compiled bf16 kernels batch-invariant is a GPU question: tests/engine/test_stage0_bf16_batch.py on the H200."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model.layers import BATCH_INVARIANT_OPTIONS
from engine.stage0 import DecodeRules, Stage0Config, Stage0Engine
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batch_invariant_compiles_the_layer_without_split_reductions(monkeypatch: pytest.MonkeyPatch,
                                                                      batch_invariant: bool) -> None:
    calls: list[dict[str, Any]] = []

    def recording(fn: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return fn  # what torch.compile is asked matters here, not the compile (which costs 20 s on a CPU)

    monkeypatch.setattr(torch, "compile", recording)
    config = Stage0Config(max_sessions=2, compile_mode="default", eager_replay_graphs=True, decode_kv_buckets=(256,),
                          decode_batch_buckets=(2,), prefill_batch_buckets=(), batch_invariant=batch_invariant)
    Stage0Engine(tiny_llm(), tiny_tokenizer(), FakeFrontEnd(), lambda _: None, config, DecodeRules())
    assert calls, "the graph sets compiled nothing"
    for kwargs in calls:
        options = kwargs.get("options") or {}
        assert all(options.get(k) == v for k, v in BATCH_INVARIANT_OPTIONS.items()) is batch_invariant
        assert ("mode" in kwargs) is not batch_invariant  # torch.compile takes a mode or options, never both
