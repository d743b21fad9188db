"""docs/deploy.md §7: the sizing table equals bench/memory_table.py, whose formulas match the spec and
the bytes the engines really allocate per session slot."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

import pytest
import torch

from engine.config import LLMConfig, TTSConfig
from engine.model.llm import SlotKVCache
from engine.model.tts import TTSKVCache
from tests.deploy.compose import REPO

DOC = REPO / "docs" / "deploy.md"
BLOCK = re.compile(r"<!-- memory_table:begin[^>]*-->\n(?P<body>.*?)<!-- memory_table:end -->", re.S)
KiB = 1024

# Full-size shapes (model.md §1.2, §1.5); token ids are irrelevant to sizes.
FULL_LLM = LLMConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151748, max_position_embeddings=40960,
                     rope_theta=1e6, rms_norm_eps=1e-6)
FULL_TTS = TTSConfig(llm_dim=4096, hidden_size=768, intermediate_size=3072, num_hidden_layers=20,
                     num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096,
                     num_audio_tokens=6562, num_text_tokens=152064, audio_bos_token_id=0)


@pytest.fixture(scope="module")
def mt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("memory_table", REPO / "bench" / "memory_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_table"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_doc_table_is_the_script_output(mt: ModuleType) -> None:
    m = BLOCK.search(DOC.read_text())
    assert m, "docs/deploy.md lost its memory_table markers"
    assert m["body"] == mt.render(mt.default_sizing()), "regenerate: python bench/memory_table.py"


def test_bytes_per_position_match_model_md_7_1(mt: ModuleType) -> None:
    s = mt.default_sizing()
    assert s.llm_per_pos == 147_456 and s.audio_per_frame == 98_304 and s.tts_per_pos == 61_440
    assert s.stream.n_timesteps == 5 and s.t2w_per_frame == (5 * 128 + 40) * KiB  # model.md §6.9
    assert s.t2w_frames == s.prompt_frames + 150 and s.prompt_frames == 500  # T <= P + 150, 10 s voice


def _allocated_bytes(cache: SlotKVCache | TTSKVCache) -> int:
    return sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))


def test_slot_sizes_are_what_the_engines_allocate(mt: ModuleType) -> None:
    """Allocate (on the meta device) exactly what Stage0/Stage1 reserve and compare per slot."""
    s = mt.default_sizing()
    llm = SlotKVCache.allocate(FULL_LLM, 3, s.llm_slot_positions, dtype=torch.bfloat16, device="meta")
    tts = TTSKVCache.allocate(FULL_TTS, 3, s.tts.max_turn_positions, dtype=torch.bfloat16, device="meta")
    per = s.per_session()
    assert _allocated_bytes(llm) == 4 * per["LLM KV (slot)"]  # 3 sessions + the scratch slot
    assert _allocated_bytes(tts) == 4 * per["TTS KV (slot)"]
    assert s.shared()["scratch slots"] == per["LLM KV (slot)"] + per["TTS KV (slot)"]


def test_max_sessions_is_the_largest_count_that_fits(mt: ModuleType) -> None:
    s = mt.default_sizing()
    per, shared = sum(s.per_session().values()), sum(s.shared().values())
    for gpu in mt.GPUS:
        n, total = s.max_sessions(gpu), gpu.total_mib * mt.MiB
        assert shared + n * per <= total < shared + (n + 1) * per


def test_prose_numbers_follow_the_table(mt: ModuleType) -> None:
    s, text = mt.default_sizing(), DOC.read_text()
    h20, h100, h200 = mt.GPUS
    assert f"reserves {sum(s.per_session().values()) / mt.GiB:.2f} GiB" in text
    assert (f"{s.max_sessions(h200)} sessions on an H200, {s.max_sessions(h20)} on an H20 and "
            f"{s.max_sessions(h100)} on an\nH100") in text
    for gpu in (h200, h20, h100):
        assert f"{s.llm_floor_ms_per_s(gpu, s.max_sessions(gpu)):.0f} ms" in text, gpu.name
