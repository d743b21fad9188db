"""The shared fence rule and request codec of the stage adapters (pure, no server)."""

from __future__ import annotations

import numpy as np
import pytest

from model_repository.common.codec import RequestError, StageRequest, parse_request, request_arrays
from model_repository.common.sessions import SessionTable


def req(op: str, fence: tuple[int, int, int], corrid: int = 7, **kw: object) -> StageRequest:
    return StageRequest(corrid=corrid, op=op, fence=fence, **kw)


def code_of(table: SessionTable, r: StageRequest) -> str:
    with pytest.raises(RequestError) as err:
        table.admit(r)
    return err.value.code


def test_fence_rules() -> None:
    t = SessionTable(max_sessions=2, idle_ttl_s=60)
    assert code_of(t, req("append", (1, 1, 1))) == "session_not_found"
    t.admit(req("open", (1, 1, 0)))
    t.admit(req("append", (1, 1, 1)))
    assert code_of(t, req("append", (1, 1, 1))) == "stale_fence"  # replayed unit
    t.admit(req("cancel", (1, 1, 0), next_fence=(1, 2, 0)))
    assert code_of(t, req("append", (1, 1, 2))) == "stale_fence"  # old epoch, forever
    t.admit(req("append", (1, 2, 1)))
    t.admit(req("close", (1, 2, 0)))
    assert code_of(t, req("append", (1, 2, 2))) == "session_not_found"


def test_capacity_and_isolation() -> None:
    t = SessionTable(max_sessions=1, idle_ttl_s=60)
    t.admit(req("open", (1, 1, 0), corrid=1))
    assert code_of(t, req("open", (1, 1, 0), corrid=2)) == "runtime_backpressure"
    assert code_of(t, req("open", (1, 1, 0), corrid=1)) == "invalid_request"


def test_idle_sessions_expire() -> None:
    t = SessionTable(max_sessions=1, idle_ttl_s=1e-9)
    t.admit(req("open", (1, 1, 0)))
    assert t.expire_idle() == [7]
    assert 7 not in t


def test_codec_round_trip() -> None:
    pcm = np.linspace(-1, 1, 16, dtype=np.float32)
    arrays = request_arrays("append", (3, 4, 5), pcm=pcm, config={"a": 1}, force_listen=True)
    parsed = parse_request(arrays.get, corrid=9, start=False, end=False)
    assert (parsed.op, parsed.fence, parsed.config, parsed.force_listen) == ("append", (3, 4, 5), {"a": 1}, True)
    np.testing.assert_array_equal(parsed.pcm, pcm)


@pytest.mark.parametrize("arrays,code", [
    ({"FENCE": np.zeros((1, 3), np.int64)}, "invalid_request"),
    ({**request_arrays("jump", (1, 1, 1))}, "invalid_request"),
    ({**request_arrays("cancel", (1, 1, 1))}, "invalid_request"),
    ({**request_arrays("append", (1, 1, 1)), "PCM": np.zeros((1, 4), np.float64)}, "bad_audio"),
    ({**request_arrays("open", (1, 1, 0)), "CONFIG": np.array([[b"{nope"]], dtype=np.object_)},
     "invalid_runtime_config"),
])
def test_malformed_requests_get_typed_codes(arrays: dict[str, np.ndarray], code: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(arrays.get, corrid=1, start=False, end=False)
    assert err.value.code == code
