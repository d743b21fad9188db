"""Identifier formats of protocol.md §4.1 and server event ids (§1.4)."""

from __future__ import annotations

import secrets

_B32 = "0123456789abcdefghijklmnopqrstuv"
MAX_CORRELATION_ID = 2**63 - 1


def session_id() -> str:
    return "sess_" + secrets.token_hex(16)


def response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def user_item_id() -> str:
    return "item_" + secrets.token_hex(12)


def assistant_item_id(resp_id: str) -> str:
    return "item_" + resp_id


def correlation_id() -> int:
    """Triton sequence id: random non-zero 63-bit integer (a UINT64 CORRID that fits INT64 too)."""
    return secrets.randbelow(MAX_CORRELATION_ID) + 1


class EventIds:
    """`evt_<base32 counter><random>`: unique within a session, never equal to a client id."""

    def __init__(self) -> None:
        self._n = 0

    def next(self) -> str:
        self._n += 1
        n, digits = self._n, ""
        while n:
            n, r = divmod(n, 32)
            digits = _B32[r] + digits
        return f"evt_{digits}{secrets.token_hex(3)}"
