"""Incremental detokenization (issue 16) == decoding all of a unit's ids at once, at every step."""

from __future__ import annotations

import random

from engine.stage0.detok import IncrementalText
from tests.engine.test_stage0_helpers import tiny_ids, tiny_tokenizer


def _check(decode, ids: list[int]) -> int:
    """Feeds `ids`, peeking each before pushing it; returns how many decode calls it made."""
    calls = []

    def counted(part: list[int]) -> str:
        calls.append(len(part))
        return decode(part)

    text = IncrementalText(counted)
    for n, t in enumerate(ids):
        assert text.with_token(t) == decode(ids[:n + 1])
        assert text.push(t) == decode(ids[:n + 1]) and text.ids == ids[:n + 1]
    return len(calls)


def test_byte_level_text_equals_full_decode_with_split_characters_and_specials() -> None:
    tok, specials = tiny_tokenizer(), tiny_ids()
    rng = random.Random(0)
    words = "héllo wörld 你好 🙂 ok".encode()  # 1- to 4-byte characters: tokens end inside characters
    for _ in range(30):
        ids = [rng.choice(list(words)) for _ in range(rng.randint(1, 25))]
        for _ in range(3):  # special tokens decode to nothing, wherever they fall
            ids.insert(rng.randint(0, len(ids)), rng.choice([specials.turn_eos, specials.tts_bos]))
        ids += [rng.randint(0x80, 0xBF)]  # a stray continuation byte at the end: U+FFFD stays
        calls = _check(tok.decode, ids)
        assert calls == len(ids)  # one decode per token: the peek and the push share it


def test_a_decoder_that_rewrites_across_tokens_falls_back_to_a_full_decode() -> None:
    def strip_decode(ids: list[int]) -> str:  # drops the first character, as a leading-space-stripping decoder
        return "".join(chr(97 + i % 26) for i in ids)[1:]

    _check(strip_decode, list(range(12)))
