"""bf16 batched == solo on the GPU (issue 16): one session alone and among 31 others gives the same tokens,
in the serving configuration (CUDA graphs, compiled forward, merged close, the candidate sampler).
Needs CUDA; skipped elsewhere. Run on the H200:
    python -m pytest tests/engine/test_stage0_bf16_batch.py -q
"""

from __future__ import annotations

import pytest
import torch

from engine.stage0 import DecodeRules, Fence, SamplingParams, Stage0Config, Stage0Engine, TokenEvent
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer, unit_pcm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SESSIONS, UNITS, WATCHED = 32, 4, 5


def _tokens(sids: list[int], compile_mode: str | None, batch_invariant: bool, smallest: int) -> dict[int, list[int]]:
    model = tiny_llm().cuda().to(torch.bfloat16)
    config = Stage0Config(max_sessions=SESSIONS, compile_mode=compile_mode, decode_kv_buckets=(512,),
                          decode_batch_buckets=tuple(b for b in (1, 2, 4, 8, 16, 32) if b >= smallest),
                          prefill_batch_buckets=tuple(b for b in (1, 2, 8, 32) if b >= smallest),
                          batch_invariant=batch_invariant)
    events: list = []
    engine = Stage0Engine(model, tiny_tokenizer(), FakeFrontEnd(), events.append, config,
                          DecodeRules(force_listen_count=0))
    for i in sids:
        engine.open(f"s{i}", Fence(1, 0), params=SamplingParams(temperature=1.5, seed=i))
    for k in range(UNITS):
        for i in sids:
            engine.append(f"s{i}", Fence(1, 0, seq=k), unit_pcm(i, k))
        engine.run_until_idle()
    return {i: [e.token_id for e in events if isinstance(e, TokenEvent) and e.session_id == f"s{i}"] for i in sids}


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")
@pytest.mark.parametrize(("compile_mode", "batch_invariant", "smallest"),
                         [(None, False, 1), ("default", False, 1), ("default", True, 1), ("default", False, 2)])
def test_bf16_session_alone_equals_among_31_others(compile_mode: str | None, batch_invariant: bool,
                                                   smallest: int) -> None:
    """`smallest`: the smallest graph batch bucket (2: a lone session's graphs run padded to 2 rows, so no
    graph is compiled for a batch of 1, which torch.compile specialises even with dynamic shapes)."""
    crowd = _tokens(list(range(SESSIONS)), compile_mode, batch_invariant, smallest)
    alone = _tokens([WATCHED], compile_mode, batch_invariant, smallest)
    assert len(alone[WATCHED]) > UNITS and alone[WATCHED] == crowd[WATCHED]
