"""Tokenizer wrapper and special-token resolution (model.md §4), on the tiny tokenizer (§9.3)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from engine.config import ModelConfig
from engine.tokenizer import REQUIRED_TOKENS, VISION_TOKENS, Tokenizer, TokenizerError, load_tokenizer

# The real ids (model.md §4.1, Demo-Cfg added_tokens.json) -- only to prove the tiny ids differ.
REAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<image>": 151669,
            "</image>": 151670, "<slice>": 151679, "</slice>": 151680, "<unit>": 151683, "</unit>": 151684,
            "<|audio_start|>": 151697, "<|audio_end|>": 151699, "<|tts_bos|>": 151703, "<|listen|>": 151705,
            "<|speak|>": 151706, "<|turn_eos|>": 151717, "<|chunk_eos|>": 151718,
            "<|chunk_tts_eos|>": 151721, "<|tts_pad|>": 151722}
TEXTS = ["<|im_start|>system\nStreaming Omni Conversation.\n<|audio_start|>",
         "héllo wörld 123 it's  a\n\n test<|speak|>ok<|turn_eos|>", "日本語 🎉 tabs\tand\r\nCRLF", ""]
TOKENIZER_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json",
                   "tokenizer_config.json")


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def _cfg(path: Path, with_vision: bool = True) -> ModelConfig:
    return ModelConfig.from_file(path / "config.json", with_vision=with_vision)


def test_special_ids_resolve_and_differ_from_real(tiny_ckpt: Path) -> None:
    cfg = _cfg(tiny_ckpt)
    tok, sp = load_tokenizer(tiny_ckpt, cfg)
    names = {**REQUIRED_TOKENS, **(VISION_TOKENS if cfg.vision else {})}
    for field, token in names.items():
        tid = getattr(sp, field)
        assert tok.backend.id_to_token(tid) == token
        assert tid != REAL_IDS[token]
        assert tid < cfg.llm.vocab_size
    assert sp.eos == sp.im_end and sp.pad == tok.token_to_id("<|endoftext|>")
    assert sp.bad_token_ids == (0, 1, 2) == tok.bad_token_ids
    assert sp.tts_audio_bos == cfg.tts.audio_bos_token_id and sp.tts_code_eos == cfg.tts.num_audio_tokens - 1
    assert len({getattr(sp, f) for f in names}) == len(names)  # all distinct


def test_matches_transformers_qwen2(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Independent reference: transformers' Qwen2TokenizerFast on the same files, with and without merges."""
    from transformers import Qwen2TokenizerFast

    d = _copy_tokenizer(tiny_ckpt, tmp_path / "tok")
    # Add a few merges so the Qwen2 pre-tokeniser split and BPE ranks matter. Merged symbols take the
    # ids after the bytes and the added tokens shift up, keeping ids contiguous as in the real files.
    vocab = json.loads((d / "vocab.json").read_text())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "1 2"]
    vocab |= {"".join(m.split()): 256 + i for i, m in enumerate(merges)}
    shift = len(merges)
    added = {t: i + shift for t, i in json.loads((d / "added_tokens.json").read_text()).items()}
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["added_tokens_decoder"] = {str(int(i) + shift): v for i, v in tc["added_tokens_decoder"].items()}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "added_tokens.json").write_text(json.dumps(added))
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    ours, ref = Tokenizer.from_dir(d), Qwen2TokenizerFast.from_pretrained(str(d))
    for text in [*TEXTS, "the thin 1234 in the the"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert 258 in ours.encode(" the")  # a merge actually applied


def test_decode_skip_special_drops_specials(tiny_ckpt: Path) -> None:
    tok, sp = load_tokenizer(tiny_ckpt, _cfg(tiny_ckpt))
    ids = [sp.speak, *tok.encode("Hi there."), sp.chunk_eos, sp.turn_eos, sp.tts_bos, sp.listen]
    assert tok.decode(ids, skip_special_tokens=True) == "Hi there."
    assert "<|speak|>" in tok.decode(ids, skip_special_tokens=False)
    # Special strings inside text are recognised as single tokens (add_special_tokens=False, §3.2).
    assert tok.encode("<|audio_end|><|im_end|>") == [sp.audio_end, sp.im_end]
    for tid in sp.token_ids().values():
        assert tok.is_special(tid)


def test_tokenizer_json_variant(tiny_ckpt: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer(tiny_ckpt, tmp_path / "tokjson")
    Tokenizer.from_dir(d).backend.save(str(d / "tokenizer.json"))
    for name in ("vocab.json", "merges.txt", "added_tokens.json"):
        (d / name).unlink()
    a, b = Tokenizer.from_dir(tiny_ckpt), Tokenizer.from_dir(d)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)


@pytest.mark.parametrize("token", ["<|tts_pad|>", "<unit>"])
def test_missing_required_token_fails(tiny_ckpt: Path, tmp_path: Path, token: str) -> None:
    d = _copy_tokenizer(tiny_ckpt, tmp_path / "tok")
    added = json.loads((d / "added_tokens.json").read_text())
    del added[token]
    (d / "added_tokens.json").write_text(json.dumps(added))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["added_tokens_decoder"] = {k: v for k, v in tc["added_tokens_decoder"].items() if v["content"] != token}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(TokenizerError, match=token.replace("|", r"\|")):
        load_tokenizer(d, _cfg(d))


def test_vision_tokens_only_required_with_vision(tiny_ckpt: Path) -> None:
    tok = Tokenizer.from_dir(tiny_ckpt)
    _, sp = load_tokenizer(tiny_ckpt, _cfg(tiny_ckpt, with_vision=False))
    assert sp.image_start is None and sp.slice_end is None
    assert tok.token_to_id("<image>") is not None


def test_ids_must_fit_vocab(tiny_ckpt: Path) -> None:
    cfg = _cfg(tiny_ckpt)
    tok = Tokenizer.from_dir(tiny_ckpt)
    small = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, vocab_size=260))
    with pytest.raises(TokenizerError, match="not < vocab_size"):
        from engine.tokenizer import SpecialTokens, read_tokenizer_config

        SpecialTokens.resolve(tok, small, read_tokenizer_config(tiny_ckpt))


def test_bad_token_ids_default_empty(tiny_ckpt: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer(tiny_ckpt, tmp_path / "tok")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    del tc["bad_token_ids"]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    _, sp = load_tokenizer(d, _cfg(d))
    assert sp.bad_token_ids == ()


def test_satisfies_stage0_seam(tiny_ckpt: Path) -> None:
    """Stage0 consumes the tokenizer through its `TextTokenizer` protocol and resolves its own ids."""
    from engine.stage0.config import SpecialIds

    cfg = _cfg(tiny_ckpt)
    tok, sp = load_tokenizer(tiny_ckpt, cfg)
    ids = SpecialIds.from_tokenizer(tok, cfg.llm.vocab_size)
    assert (ids.listen, ids.unit_open, ids.tts_pad, ids.bad_token_ids) == (sp.listen, sp.unit_start,
                                                                           sp.tts_pad, sp.bad_token_ids)
    with pytest.raises(KeyError):
        tok.token_id("<|not_a_token|>")
