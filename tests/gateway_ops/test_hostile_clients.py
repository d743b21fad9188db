"""Issue 18 points 4, 5 and 7: hostile or careless frames and requests, through the real app over real sockets.

Every malformed frame gets its typed error and the session carries on (or a handshake is refused with the
documented code); a key-less server answers only to loopback host names (DNS rebinding); an 8-bit WAV is
refused; a key put into the URL never reaches the log.
"""

from __future__ import annotations

import base64
import io
import logging

import numpy as np
import pytest
import soundfile
import websockets

from gateway.observability import RedactSecrets, redact_server_logs
from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.harness import serve
from tests.gateway_ops.wire import Raw, http_get, opened, raw

HUGE_INT = "1" * 5001  # past CPython's int max str digits (4300): json.loads raises a bare ValueError


async def _still_alive(c: Raw) -> None:
    await c.send({"type": "session.heartbeat", "event_id": "alive"})
    ack = await c.until("session.heartbeat_ack")
    assert ack["session_id"]


async def _rejected(c: Raw, text: str) -> dict:
    await c.ws.send(text)
    return (await c.until("error"))["error"]


async def test_huge_integer_is_invalid_json_and_the_session_goes_on() -> None:
    async with serve(FakeRuntime()) as addr:
        c, _ = await opened(addr)
        err = await _rejected(c, '{"type": "session.heartbeat", "event_id": "big", "n": ' + HUGE_INT + "}")
        assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
        await _still_alive(c)
        await c.ws.close()


async def test_huge_integer_opener_is_a_handshake_invalid_json() -> None:
    async with serve(FakeRuntime()) as addr, raw(addr, "/v1/duplex") as c:
        await c.ws.send('{"type": "session.create", "n": ' + HUGE_INT + "}")
        err = await c.recv()
        assert err["type"] == "error" and err["code"] == "invalid_json", err  # native: flat error
        assert await c.closed() == (1008, "invalid_json")


@pytest.mark.parametrize("frame", [
    r'{"type": "session.heartbeat", "event_id": "\udfff"}',  # lone low surrogate in the echoed id
    r'{"type": "response.explode", "event_id": "\ud800x"}',  # a frame that is rejected anyway
    r'{"type": "session.update", "session": {"instructions": "hi \udfff"}}',  # deep inside
])
async def test_lone_surrogate_is_invalid_json_and_the_session_goes_on(frame: str) -> None:
    async with serve(FakeRuntime()) as addr:
        c, _ = await opened(addr)
        await c.ws.send(frame)
        ev = await c.until("error")
        assert ev["error"]["code"] == "invalid_json", ev
        assert "surrogate" in ev["error"]["message"]
        await _still_alive(c)
        await c.ws.close()


async def test_escaped_valid_unicode_still_passes() -> None:
    async with serve(FakeRuntime()) as addr:
        c, _ = await opened(addr)
        await c.ws.send(r'{"type": "session.heartbeat", "event_id": "\ud83d\ude00 ok \u00e9"}')  # a surrogate PAIR
        ack = await c.until("session.heartbeat_ack")
        assert ack["type"] == "session.heartbeat_ack"
        assert not [e for e in c.events if e["type"] == "error"]
        await c.ws.close()


def _wav(subtype: str) -> str:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(1600, np.float32), 16000, format="WAV", subtype=subtype)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(("subtype", "accepted"), [("PCM_U8", False), ("PCM_24", False), ("PCM_16", True),
                                                   ("FLOAT", True)])
async def test_wav_append_is_pcm16_or_float32_only(subtype: str, accepted: bool) -> None:
    async with serve(FakeRuntime()) as addr:
        c, _ = await opened(addr)
        await c.send({"type": "input_audio_buffer.append", "event_id": "w", "format": "wav",
                      "audio": _wav(subtype)})
        await _still_alive(c)
        errors = [e["error"] for e in c.events if e["type"] == "error"]
        if accepted:
            assert errors == []
        else:
            assert [(e["code"], e["param"]) for e in errors] == [("bad_audio", "audio")], errors
            assert subtype in errors[0]["message"]
        await c.ws.close()


async def _ws_with_host(addr: str, host: str, **kw: object) -> Raw:
    """A socket to `addr` that names the server `host` (as a rebinding page's browser would)."""
    ip, port = addr.split(":")
    ws = await websockets.connect(f"ws://{host}:{port}/v1/realtime", host=ip, port=int(port), max_size=None,
                                  **kw)  # type: ignore[arg-type]
    return Raw(ws)


async def test_keyless_server_refuses_a_rebound_host_name() -> None:
    async with serve(FakeRuntime(), max_sessions=8) as addr:
        port = addr.split(":")[1]
        c = await _ws_with_host(addr, "evil.example", origin=f"http://evil.example:{port}")
        err = await c.recv()
        assert err["error"]["code"] == "host_not_allowed", err
        assert await c.closed() == (1008, "host_not_allowed")
        r = await http_get(addr, "/v1/models", headers={"Host": f"evil.example:{port}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        for good in ("localhost", "127.0.0.1", "app.localhost"):
            c = await _ws_with_host(addr, good)
            assert (await c.recv())["type"] == "session.created", good
            await c.ws.close()
        assert (await http_get(addr, "/health", headers={"Host": "evil.example"})).status_code == 200  # probes


async def test_configured_host_and_keyed_server_accept_other_names() -> None:
    async with serve(FakeRuntime(), allowed_hosts=("voice.internal",)) as addr:
        c = await _ws_with_host(addr, "voice.internal")
        assert (await c.recv())["type"] == "session.created"
        await c.ws.close()
    async with serve(FakeRuntime(), api_keys=("sk-k",)) as addr:  # with a key, the key is the guard
        c = await _ws_with_host(addr, "gpu.example", additional_headers={"Authorization": "Bearer sk-k"})
        assert (await c.recv())["type"] == "session.created"
        await c.ws.close()


def test_key_in_the_url_is_redacted_from_server_logs() -> None:
    redact_server_logs()
    redact_server_logs()  # idempotent: one filter per logger
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    access, error = logging.getLogger("uvicorn.access"), logging.getLogger("uvicorn.error")
    assert sum(isinstance(f, RedactSecrets) for f in access.filters) == 1
    handler = Keep()
    access.addHandler(handler)
    error.addHandler(handler)
    try:
        access.warning('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/v1/models?api_key=sk-SECRET&x=1",
                       "1.1", 401)
        error.warning('%s - "WebSocket %s" [accepted]', "127.0.0.1:5", "/v1/realtime?model=m&API_KEY=sk-SECRET")
    finally:
        access.removeHandler(handler)
        error.removeHandler(handler)
    assert len(seen) == 2 and not any("sk-SECRET" in line for line in seen), seen
    assert "api_key=[redacted]&x=1" in seen[0] and "model=m&API_KEY=[redacted]" in seen[1]
