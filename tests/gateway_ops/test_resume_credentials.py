from __future__ import annotations

import base64
import hashlib
import hmac

from gateway.resume import credentials as cr
from gateway.resume.credentials import ResumeCredential


def test_token_is_256_bit_base64url_unpadded() -> None:
    cred, token = ResumeCredential.issue()
    assert len(token) == 43 and "=" not in token
    raw = base64.urlsafe_b64decode(token + "=")
    assert len(raw) == 32
    assert cred.verify(token)
    assert ResumeCredential.issue()[1] != token


def test_only_sha256_digest_is_stored_and_never_shown() -> None:
    cred, token = ResumeCredential.issue()
    stored = [getattr(cred, name) for name in cred.__slots__]
    assert token not in repr(cred) and token not in str(stored)
    assert hashlib.sha256(token.encode()).digest() in stored  # independent digest computation
    rot = cred.prepare_rotation()
    assert rot.token not in repr(rot)


def test_compare_uses_hmac_compare_digest(monkeypatch) -> None:  # noqa: ANN001
    calls = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(cr.hmac, "compare_digest", spy)
    cred, token = ResumeCredential.issue()
    assert cred.verify(token) and calls


def test_wrong_or_malformed_tokens_rejected() -> None:
    cred, token = ResumeCredential.issue()
    flipped = ("A" if token[0] != "A" else "B") + token[1:]
    for bad in (flipped, "", token + "x", None, 42, token.encode()):
        assert not cred.verify(bad)


def test_rotation_lifecycle_with_one_shot_previous() -> None:
    cred, old = ResumeCredential.issue()
    rot = cred.prepare_rotation()
    assert not cred.verify(rot.token)  # nothing changes before session.resumed is written
    assert cred.verify(old)
    cred.commit_rotation(rot)
    assert cred.verify(rot.token) and cred.verify(old)  # lost session.resumed: old still works once
    cred.first_frame_received()
    assert cred.verify(rot.token) and not cred.verify(old)


def test_lost_delivery_discards_new_token() -> None:
    cred, old = ResumeCredential.issue()
    rot = cred.prepare_rotation()
    # session.resumed could not be written: the rotation is simply never committed
    assert cred.verify(old) and not cred.verify(rot.token)


def test_second_rotation_revokes_the_oldest() -> None:
    cred, t1 = ResumeCredential.issue()
    r2 = cred.prepare_rotation()
    cred.commit_rotation(r2)
    r3 = cred.prepare_rotation()
    cred.commit_rotation(r3)
    assert not cred.verify(t1) and cred.verify(r2.token) and cred.verify(r3.token)
