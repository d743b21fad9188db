"""Padded GEMM rows (`layers.linear`, `Qwen3LLM.pad_gemm_rows`, Stage0Config.gemm_min_rows): cuBLAS picks its
kernel by the row count, and on the H200 a row's logits alone differed from the same row among 2-64 others
until the rows were padded to 32 (bench/RESULTS.md stop 36). Here: the padding keeps the values and shapes, a
padded row's numbers do not depend on the other rows, and the engine applies the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import layers
from engine.model.layers import linear, verify_one_gemm_tiles
from engine.model.llm import SlotKVCache
from engine.stage0 import DecodeRules, Stage0Config, Stage0Engine
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs
from tests.engine.test_stage0_helpers import TINY, FakeFrontEnd, tiny_llm, tiny_tokenizer


def test_linear_pads_short_inputs_and_cuts_the_result_back() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1, 16, generator=gen), torch.randn(5, 16, generator=gen)
    out = linear(x, w, 32)
    assert out.shape == (3, 1, 5)
    torch.testing.assert_close(out, F.linear(x, w))
    big = torch.randn(40, 16, generator=gen)
    assert torch.equal(linear(big, w, 32), F.linear(big, w))  # enough rows: the plain GEMM


def test_tiled_linear_runs_every_gemm_on_exactly_the_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """tile: more rows than the tile run as chunks of exactly that many rows (the last padded), with the bias,
    the values of the plain GEMM; through torch.compile (dynamic rows) too."""
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(6, 16, generator=gen), torch.randn(6, generator=gen)
    seen, plain = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.shape[0]) or plain(x, *a))
    for rows in (3, 8, 9, 20):
        seen.clear()
        x = torch.randn(rows, 1, 16, generator=gen)
        out = linear(x, w, 8, True, b)
        assert out.shape == (rows, 1, 6) and set(seen) == {8} and len(seen) == -(-rows // 8)
        torch.testing.assert_close(out, plain(x, w, b))
    monkeypatch.setattr(F, "linear", plain)
    compiled = torch.compile(lambda x: linear(x, w, 8, True, b), dynamic=True, fullgraph=True)
    for rows in (5, 17, 30):
        x = torch.randn(rows, 16, generator=gen)
        torch.testing.assert_close(compiled(x), plain(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_do_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """With 32 rows padded, a row's logits and its dense decode hidden state are the same bits alone and among
    up to 31 others (each call is one 32-row GEMM, whatever the count)."""
    model = tiny_llm().to(dtype).pad_gemm_rows(32)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, model.cfg.hidden_size, generator=gen).to(dtype)
    alone = model.logits(hidden[:1])[0]
    for n in (2, 5, 16, 32):
        assert torch.equal(model.logits(hidden[:n])[0], alone), n
    assert model.min_rows == 32 and {layer.self_attn.min_rows for layer in model.model.layers} == {32}
    assert model.pad_gemm_rows(0).min_rows == 0


def test_engine_applies_gemm_min_rows() -> None:
    model = tiny_llm()
    Stage0Engine(model, tiny_tokenizer(), FakeFrontEnd(), lambda e: None, Stage0Config(max_sessions=2, gemm_min_rows=8),
                 DecodeRules())
    assert model.min_rows == 8 and {layer.mlp.min_rows for layer in model.model.layers} == {8}
    with pytest.raises(ValueError, match="gemm_min_rows"):
        Stage0Config(gemm_min_rows=-1)


def _rows_seen(model: torch.nn.Module) -> list[int]:
    """The MLP's least rows at each call of layer 0 (a forward hook, so eager replays report theirs)."""
    seen: list[int] = []
    model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: seen.append(mod.min_rows))
    return seen


def test_graph_sets_pad_their_gemms_to_their_largest_bucket() -> None:
    """A decode graph runs its GEMMs at its set's largest bucket's rows, a unit prefill graph at the largest
    bucket x its length (rounded up to a power of two, up to BUCKET_PAD_MAX_ROWS), so a row's numbers are the same in every bucket; longer rows
    and the forward outside graphs keep the model's own least rows."""
    model = tiny_llm().pad_gemm_rows(8)
    kv = SlotKVCache.allocate(TINY, 16, 64, dtype=torch.float32)
    decode = DecodeGraphs.create(model, kv, (2, 4, 16), (32,), eager_replay=True)
    prefill = PrefillGraphs.create(model, kv, (2, 4, 8), (2, 13, 79), (32,), eager_replay=True)
    assert decode is not None and prefill is not None
    assert {decode.gemm_rows(key) for key in decode.steps} == {16}
    assert {t: prefill.gemm_rows((2, t, 32)) for t in (2, 13, 79)} == {2: 16, 13: 128, 79: 8}  # 8 x 13 -> 128; 8 x 79 > 128
    seen = _rows_seen(model)
    x = torch.randn(2, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    decode.run(x, torch.tensor([3, 4]), torch.tensor([0, 1]), reach=5)
    prefill.run([0, 1], [5, 6], [torch.randn(13, TINY.hidden_size)] * 2)
    prefill.run([0], [0], [torch.randn(40, TINY.hidden_size)])
    assert seen == [16, 128, 8]
    assert model.gemm_min_rows == 8 and model.min_rows == 8  # restored after each graph; logits keep theirs
    with torch.no_grad():
        model(x[:, None], torch.tensor([[3], [4]]), None, kv)
    assert seen[-1] == 8


def test_pad_buckets_off_keeps_the_models_least_rows() -> None:
    model = tiny_llm().pad_gemm_rows(8)
    kv = SlotKVCache.allocate(TINY, 16, 64, dtype=torch.float32)
    decode = DecodeGraphs.create(model, kv, (2, 4, 16), (32,), eager_replay=True, pad_buckets=False)
    prefill = PrefillGraphs.create(model, kv, (2, 8), (13,), (32,), eager_replay=True, pad_buckets=False)
    assert decode is not None and prefill is not None
    assert {decode.gemm_rows(key) for key in decode.steps} | {prefill.gemm_rows(key) for key in prefill.steps} == {8}


def test_engine_passes_gemm_pad_buckets_to_its_graph_sets() -> None:
    for pad in (True, False):
        engine = Stage0Engine(tiny_llm(), tiny_tokenizer(), FakeFrontEnd(), lambda e: None,
                              Stage0Config(max_sessions=4, eager_replay_graphs=True, gemm_pad_buckets=pad,
                                           decode_kv_buckets=(256,), max_context=1024, eviction="off"),
                              DecodeRules())
        decode, prefill = engine.runner.graphs, engine.runner.prefill_graphs
        assert decode is not None and prefill is not None
        assert decode.pad_buckets is pad and prefill.pad_buckets is pad


def test_bucket_padding_keeps_a_graph_rows_values() -> None:
    """Padding changes which GEMM kernel runs, never the values beyond its rounding: the padded decode graph equals
    the unpadded one to fp32 tolerance, and with gemm_min_rows 0 no graph pads."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, TINY.hidden_size, generator=gen)
    outs = []
    for rows in (0, 4):
        model = tiny_llm().pad_gemm_rows(rows)
        kv = SlotKVCache.allocate(TINY, 16, 64, dtype=torch.float32)
        decode = DecodeGraphs.create(model, kv, (2, 4, 16), (32,), eager_replay=True)
        assert decode is not None
        assert {decode.gemm_rows(key) for key in decode.steps} == ({0} if rows == 0 else {16})
        outs.append(decode.run(x, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), reach=4))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_tts_gemm_tile_rows_tiles_every_tts_gemm_and_keeps_the_values() -> None:
    """TTSEngineConfig.gemm_tile_rows reaches every backbone GEMM, the projector and the code head; tiled logits
    and condition rows equal the untiled ones to fp32 rounding, and a row's are the same bits alone and among
    more rows than one tile."""
    from engine.stage1.config import TTSEngineConfig
    from engine.stage1.tts_engine import TTSEngine
    from tests.engine.test_tts_helpers import tiny_model

    model = tiny_model()
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(40, model.cfg.hidden_size, generator=gen)
    llm = torch.randn(40, model.cfg.llm_dim, generator=gen)
    ids = torch.randint(0, model.cfg.num_text_tokens, (40,), generator=gen)
    plain, plain_cond = model.logits(hidden), model.condition(ids, llm)
    TTSEngine(model, TTSEngineConfig(max_sessions=2, max_batch=2, gemm_tile_rows=16))
    assert model.min_rows == 16 and model.projector_semantic.tile_rows == 16
    assert {(layer.mlp.min_rows, layer.mlp.tile, layer.self_attn.tile) for layer in model.model.layers} == {
        (16, True, True)}
    torch.testing.assert_close(model.logits(hidden), plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.condition(ids, llm), plain_cond, atol=1e-5, rtol=1e-5)
    alone, alone_cond = model.logits(hidden[:1])[0], model.condition(ids[:1], llm[:1])[0]
    assert all(torch.equal(model.logits(hidden[:n])[0], alone) for n in (2, 5, 17, 40))
    assert all(torch.equal(model.condition(ids[:n], llm[:n])[0], alone_cond) for n in (2, 17, 40))
    with pytest.raises(ValueError, match="gemm_tile_rows"):
        TTSEngineConfig(gemm_tile_rows=-1)


def test_tts_gemm_tiles_leave_out_cudnn_sdpa() -> None:
    """On the H200 cuDNN's SDPA kernel made a session's TTS codes among 32 others differ from its codes alone
    (bench/RESULTS.md stop 38): with GEMM tiles every TTS layer attends through the other kernels; without tiles
    (no invariance asked) and in the LLM, torch's choice."""
    from torch.nn.attention import SDPBackend

    from tests.engine.test_tts_helpers import tiny_model

    model = tiny_model()
    assert {layer.self_attn.sdpa_backends for layer in model.model.layers} == {None}
    kernels = {layer.self_attn.sdpa_backends for layer in model.tile_gemm_rows(32).model.layers}
    assert len(kernels) == 1 and SDPBackend.CUDNN_ATTENTION not in next(iter(kernels)) and None not in kernels
    assert {layer.self_attn.sdpa_backends for layer in model.tile_gemm_rows(0).model.layers} == {None}
    assert {layer.self_attn.sdpa_backends for layer in tiny_llm().model.layers} == {None}


def test_verified_row_counts_run_as_one_gemm_with_the_tiles_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """`verify_one_gemm_tiles`: where one GEMM over a multiple of the tile gives the tiles' bits (here, on the CPU),
    `tiled_linear` runs it whole, reading the weight once; the values stay the tiles'."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 40, generator=gen).to(torch.bfloat16)  # a layout no other test uses
    x = torch.randn(21, 40, generator=gen).to(torch.bfloat16)
    tiles = torch.cat([F.linear(c, w) for c in F.pad(x, (0, 0, 0, 3)).split(8)])[:21]
    assert verify_one_gemm_tiles([w, w], 8, 24) == (2, 0)  # 16 and 24 rows; the second weight's layout: known
    seen, plain = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.shape[0]) or plain(x, *a))
    out = linear(x, w, 8, True)
    assert seen == [24] and torch.equal(out, tiles)
    seen.clear()
    linear(torch.randn(30, 40).to(torch.bfloat16), w, 8, True)  # 32 rows: past what was verified, so tiles
    assert seen == [8, 8, 8, 8]


def test_verification_reaches_the_rows_a_step_is_padded_to() -> None:
    """A step of 17 rows runs padded to 24 (three 8-row tiles): 24 is checked too. (Stop 50 checked the multiples up
    to the step's rows only, so the engine's 416-row prefill, padded to 512, kept its tiles.)"""
    w = torch.randn(20, 24, generator=torch.Generator().manual_seed(4))
    assert verify_one_gemm_tiles([w], 8, 17) == (2, 0)  # 16 and 24


def test_a_row_count_whose_gemm_differs_from_the_tiles_stays_tiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose one GEMM over 16 rows gives other bits than its 8-row tiles (here a GEMM that rounds by its
    row count) keeps the tiles at 16 rows, so a row's numbers still do not depend on what shares its step."""
    plain = F.linear

    def by_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = plain(x, weight, bias)
        return out + 1e-3 if x.shape[0] == 16 else out

    w = torch.randn(12, 40, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(F, "linear", by_rows)
    assert verify_one_gemm_tiles([w], 8, 24) == (1, 1)  # 16 rows differ, 24 agree
    seen = []
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.shape[0]) or by_rows(x, *a))
    x = torch.randn(13, 40)
    assert torch.equal(linear(x, w, 8, True), torch.cat([plain(c, w) for c in F.pad(x, (0, 0, 0, 3)).split(8)])[:13])
    assert seen == [8, 8]


def test_the_engine_verifies_its_tiled_gemms_before_any_capture() -> None:
    """Stage0Engine with `gemm_tile_rows` checks every LLM weight layout up to its graphs' rows at construction."""
    model = tiny_llm()
    Stage0Engine(model, tiny_tokenizer(), FakeFrontEnd(), lambda e: None,
                 Stage0Config(max_sessions=2, gemm_tile_rows=16, use_cuda_graphs=False))
    down = model.model.layers[0].mlp.down_proj.weight  # another test may have checked its layout first
    assert down.data_ptr() in layers._VERIFIED_WEIGHTS and layers._one_gemm_key(down, 16, 32) in layers._ONE_GEMM
