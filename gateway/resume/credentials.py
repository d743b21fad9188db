"""Resume credential (protocol.md §6.1): a 256-bit token, stored only as its SHA-256 digest.

The token string exists only in the return value of `issue` / `prepare_rotation`, for the one unsequenced
event that delivers it (`session.created` / `session.resumed`). Rotation is two-phase so that a lost
`session.resumed` keeps the old token valid, and the old token stays valid as a one-shot fallback until the
first client frame arrives on the new attachment.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN_BYTES = 32  # 256 bit from the CSPRNG (§6.1)
TOKEN_CHARS = 43  # base64url of 32 bytes without padding


def new_token() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(TOKEN_BYTES)).rstrip(b"=").decode("ascii")


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class Rotation:
    """A prepared, not yet committed new token. `repr` never shows the token."""
    token: str = field(repr=False)
    digest: bytes = field(repr=False)


class ResumeCredential:
    __slots__ = ("_current", "_previous", "on_change")

    def __init__(self, current_digest: bytes, previous_digest: bytes | None = None) -> None:
        self._current: bytes = current_digest
        self._previous: bytes | None = previous_digest
        # told after every change of the digests (several gateways: the directory's copy, gateway/directory)
        self.on_change: Callable[[], None] = lambda: None

    @classmethod
    def issue(cls) -> tuple[ResumeCredential, str]:
        """New session: the credential to keep and the token to send once in `session.created`."""
        token = new_token()
        return cls(digest(token)), token

    def digests(self) -> tuple[bytes, bytes | None]:
        """(current, one-shot previous): what a copy of the credential keeps (digests only, never a token)."""
        return self._current, self._previous

    def __repr__(self) -> str:
        return f"ResumeCredential(previous_valid={self._previous is not None})"

    def verify(self, token: object) -> bool:
        """RS3: constant-time compare against the current and the one-shot previous digest."""
        if not isinstance(token, str) or len(token) != TOKEN_CHARS:
            return False
        d = digest(token)
        ok_current = hmac.compare_digest(d, self._current)
        ok_previous = self._previous is not None and hmac.compare_digest(d, self._previous)
        return ok_current or ok_previous

    @staticmethod
    def prepare_rotation() -> Rotation:
        """RS8: a new token for `session.resumed`; nothing changes until `commit_rotation`."""
        token = new_token()
        return Rotation(token, digest(token))

    def commit_rotation(self, rotation: Rotation) -> None:
        """After `session.resumed` was written: the new token is current, the old one a one-shot fallback."""
        self._previous, self._current = self._current, rotation.digest
        self.on_change()

    def first_frame_received(self) -> None:
        """The client spoke on the new attachment, so it has the new token: revoke the previous one."""
        if self._previous is not None:
            self._previous = None
            self.on_change()
