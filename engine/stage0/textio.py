"""Adapter from a `tokenizers.Tokenizer` (tokenizer.json) to Stage0's `TextTokenizer` seam."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer


class TokenizersAdapter:
    """Wraps a fast tokenizer; `decode` skips special tokens, `encode` adds none (model.md §3.2)."""

    def __init__(self, tokenizer: Tokenizer, bad_token_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._bad = tuple(int(i) for i in bad_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_id(self, token: str) -> int:
        value = self._tok.token_to_id(token)
        if value is None:
            raise KeyError(f"token {token!r} is missing from the tokenizer")
        return int(value)

    @property
    def bad_token_ids(self) -> tuple[int, ...]:
        return self._bad
