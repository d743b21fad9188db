"""The one §3.5.4 draw primitive (engine.sampling_draw), used by Stage0 and Stage1 sampling."""

from __future__ import annotations

import torch

import engine.stage0.sampling as stage0_sampling
import engine.stage1.sampling as stage1_sampling
from engine.sampling_draw import draw, draw_uniforms, session_generator
from engine.stage0.sampling import UniformStream


def _scalar_draw(p: torch.Tensor, u: float) -> int:
    """§3.5.4 restated row by row with a Python loop over the fp32 running sum."""
    cdf = torch.cumsum(p.float(), 0)
    target = torch.tensor(u, dtype=torch.float64).float() * cdf[-1]
    for i in range(p.shape[0]):
        if cdf[i] > target:
            return i
    return max(i for i in range(p.shape[0]) if p[i] > 0)


def test_both_stages_use_the_shared_primitive() -> None:
    assert stage0_sampling.draw is draw
    assert stage1_sampling.draw is draw


def test_draw_matches_scalar_rule_including_fallback() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(40, 33, generator=g) ** 3
    probs[:, 20:] = 0.0  # trailing zeros: the fallback must pick the last positive, not the last index
    u = torch.rand(40, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1 - 1e-12  # the first positive; rounds to 1.0 in fp32 → fallback
    got = draw(probs, u)
    assert [int(x) for x in got] == [_scalar_draw(probs[b], float(u[b])) for b in range(40)]
    assert int(got[1]) == 19


def test_block_draws_equal_scalar_draws() -> None:
    a, b = session_generator(11), session_generator(11)
    block = torch.cat([draw_uniforms(a, 5), draw_uniforms(a, 1), draw_uniforms(a, 9)])
    scalars = [float(torch.rand((), dtype=torch.float64, generator=b)) for _ in range(15)]
    assert block.dtype == torch.float64
    assert block.tolist() == scalars


def test_uniform_stream_follows_the_session_generator() -> None:
    s, ref = UniformStream(5), session_generator(5)
    got = s.peek(3)
    s.consume(2)
    got += s.peek(4)[1:]
    assert got == draw_uniforms(ref, 6).tolist()


def test_uniform_stream_draws_ahead_in_blocks_with_the_same_values() -> None:
    """The stream pre-draws PREDRAW uniforms at a time; what it hands out, past several blocks and however the
    peeks and consumes interleave, is still the generator's sequence, and `consumed` counts only what was used."""
    from engine.stage0.sampling import PREDRAW

    s, ref = UniformStream(9), session_generator(9)
    got = []
    for step in range(3 * PREDRAW):
        first = s.peek(2)
        assert len(first) == 2
        used = 1 + step % 2
        got += first[:used]
        s.consume(used)
    assert s.consumed == len(got) > 2 * PREDRAW
    assert got == draw_uniforms(ref, len(got)).tolist()


def test_a_row_without_probability_mass_draws_a_valid_id() -> None:
    """NaN or all-zero rows (a graph bucket's padding) must not yield −1: TTS feeds ids to gathers."""
    probs = torch.tensor([[0.2, 0.8, 0.0], [float("nan")] * 3, [0.0, 0.0, 0.0]])
    got = draw(probs, torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64))
    assert got.tolist() == [1, 0, 0]
    stage1_sampling.window_counts(got[:, None], 3)  # in range for the repetition window
