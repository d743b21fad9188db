"""A unit's text, detokenized incrementally (issue 16): the same string as decoding all its ids at once.

Each step decodes only the ids since the last committed point plus those of the commit before (context),
and the character-cap check (model.md §3.4 B6) and the fed token share that decode. A point is committed only
where the text so far does not end in U+FFFD (a byte-level token that ends inside a UTF-8 character), so
the bytes before it decode the same alone as in the whole. Should the context's decode not be a prefix
of the longer decode (a decoder that rewrites across tokens), that call falls back to a full decode.
"""

from __future__ import annotations

from collections.abc import Callable

INCOMPLETE = "\ufffd"


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode  # skips special tokens
        self.ids: list[int] = []
        self.text = ""  # decode(ids)
        self._committed = ""  # decode(ids[:read])
        self._prefix = self._read = 0  # ids[prefix:read]: the context decoded again with the new ids
        self._head = 0  # len(decode(ids[:prefix])): the context's text is committed[head:]
        self._peeked: tuple[int, str] | None = None

    def with_token(self, token: int) -> str:
        """decode(ids + [token]), without appending: one decode of the context and the new ids."""
        if self._peeked is None or self._peeked[0] != token:
            context = self._committed[self._head:]
            tail = self._decode([*self.ids[self._prefix:], token])
            text = self._committed + tail[len(context):] if tail.startswith(context) \
                else self._decode([*self.ids, token])  # the decoder rewrote across the cut: decode it all
            self._peeked = (token, text)
        return self._peeked[1]

    def push(self, token: int) -> str:
        """Append `token` → the new text (the decode `with_token` made for it, if it was the same token)."""
        self.text = self.with_token(token)
        self.ids.append(token)
        self._peeked = None
        if not self.text.endswith(INCOMPLETE):  # a cut here splits no character: commit it
            self._head, self._prefix = len(self._committed), self._read
            self._committed, self._read = self.text, len(self.ids)
        return self.text
