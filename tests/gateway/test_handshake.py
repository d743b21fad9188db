"""Handshake, profiles, close codes and HTTP routes (protocol.md §1.1-§1.8, §2.1, §11)."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets

from gateway.serving import build
from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import connect, serve
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


async def _refused(path: str, rt: FakeRuntime | None = None, first: dict | str | None = None,
                   **settings) -> tuple[dict, int, str]:  # noqa: ANN003
    rt = rt or FakeRuntime()
    async with serve(rt, **settings) as addr, connect(addr, path) as c:
        if first is not None:
            await c.send(first)
        err = await c.recv()
        with pytest.raises(websockets.ConnectionClosed) as exc:
            await c.recv()
        rcvd = exc.value.rcvd
        return err, rcvd.code, rcvd.reason


@pytest.mark.parametrize(("path", "first", "code", "close_code"), [
    ("/v1/realtime?duplex=0", None, "unsupported", 1008),
    ("/v1/realtime?duplex=maybe", None, "bad_event", 1008),
    ("/v1/realtime?native_duplex=false", None, "unsupported", 1008),
    ("/v1/realtime?model=gpt-4o", None, "model_not_found", 1008),
    ("/v1/realtime?autostart=0", "nope", "invalid_json", 1008),
    ("/v1/realtime?autostart=0", {"type": "bogus"}, "unknown_event", 1008),
    ("/v1/realtime?autostart=0", {"type": "input_audio_buffer.commit", "event_id": "c1"}, "bad_event", 1008),
    ("/v1/realtime?autostart=0", {"type": "session.create"}, "bad_event", 1008),
    ("/v1/realtime?autostart=0", {"type": "session.update", "session": {"top_p": 1}}, "server_owned_config_key",
     1008),
    ("/v1/realtime?autostart=0&model=openbmb/MiniCPM-o-4_5", {"type": "session.update",
                                                            "session": {"model": "MiniCPM-o-4_5x"}},
     "model_not_found", 1008),
    ("/v1/realtime?resume=1", {"type": "session.update"}, "bad_event", 1008),
    ("/v1/realtime?resume=1", {"type": "session.resume", "session_id": "s", "resume_token": "t"},
     "invalid_session_resume", 1008),
    ("/v1/realtime?resume=1", {"type": "session.resume", "session_id": "s", "resume_token": "t",
                               "last_received_server_event_seq": 0}, "session_resume_expired", 1008),
])
async def test_handshake_errors_nested_on_realtime(path: str, first, code: str, close_code: int) -> None:  # noqa: ANN001
    err, got_code, reason = await _refused(path, first=first)
    assert err["type"] == "error" and err["error"]["code"] == code and "server_event_seq" not in err
    assert (got_code, reason) == (close_code, code)


async def test_handshake_errors_flat_on_duplex() -> None:
    err, got_code, reason = await _refused("/v1/duplex", first={"type": "input_audio_buffer.append",
                                                                 "event_id": "x1"})
    assert isinstance(err["error"], str) and err["code"] == "bad_event" and err["error_type"] == "invalid_request_error"
    assert err["client_event_id"] == "x1" and err["retryable"] is False and (got_code, reason) == (1008, "bad_event")


async def test_config_timeout() -> None:
    err, code, reason = await _refused("/v1/duplex", handshake_timeout_s=0.2)
    assert err["code"] == "config_timeout" and (code, reason) == (1008, "config_timeout")


async def test_runtime_unavailable_and_open_failed() -> None:
    rt = FakeRuntime()
    rt.ready = False
    err, code, reason = await _refused("/v1/realtime", rt)
    assert err["error"]["code"] == "runtime_unavailable" and err["error"]["retryable"] is True
    assert (code, reason) == (1013, "runtime_unavailable")
    rt = FakeRuntime()
    rt.fail["open"] = "internal_error"
    err, code, reason = await _refused("/v1/realtime", rt)
    assert err["error"]["code"] == "runtime_open_failed" and (code, reason) == (1011, "runtime_open_failed")


async def test_admission_limit_and_replacement_after_close() -> None:
    rt = FakeRuntime()
    async with serve(rt, max_sessions=1) as addr:
        async with connect(addr) as a:
            assert (await a.recv())["type"] == "session.created"
            async with connect(addr) as b:
                err = await b.recv()
                assert err["error"]["code"] == "resource_exhausted" and err["error"]["type"] == "rate_limit_error"
                assert err["error"]["message"] == "duplex_session_capacity_exhausted: limit=1"
            await a.send({"type": "session.close"})
            await a.until("session.closed")
        async with connect(addr) as c:  # AD-4: the slot is free again
            assert (await c.recv())["type"] == "session.created"


async def test_session_exists_and_incarnation() -> None:
    rt = FakeRuntime()
    opener = {"type": "session.update", "session": {"id": "my-session"}}
    async with serve(rt, max_sessions=2) as addr:
        async with connect(addr, "/v1/realtime?autostart=0") as a:
            await a.send(opener)
            created = await a.recv()
            assert created["session"]["id"] == "my-session" and created["incarnation"] == 1
            async with connect(addr, "/v1/realtime?autostart=0") as b:
                await b.send(opener)
                assert (await b.recv())["error"]["code"] == "session_exists"
            await a.send({"type": "session.close"})
            await a.until("session.closed")
        async with connect(addr, "/v1/realtime?autostart=0") as c:
            await c.send(opener)
            assert (await c.recv())["incarnation"] == 2  # re-opened id: previous + 1 (§4.1)


async def test_update_opener_sends_created_then_one_updated() -> None:
    rt = FakeRuntime()
    async with serve(rt) as addr, connect(addr, "/v1/realtime?autostart=0") as c:
        await c.send({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["audio"], "instructions": "Hi.",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "default"}},
            "extra_body": {"auto_response": True}}})
        created, updated = await c.recv(), await c.recv()
        events = await close(c)
    assert created["type"] == "session.created" and "server_event_seq" not in created
    assert updated["type"] == "session.updated" and updated["server_event_seq"] == 1
    s = updated["session"]
    assert s["input_audio_sample_rate_hz"] == 16000 and s["audio"]["input"]["format"] is None  # pcm16 @16k: null
    assert s["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert s["instructions"] == "Hi." and s["modalities"] == ["text", "audio"] and s["state"] == "open"
    assert created["attachment_generation"] == 1 and s["capabilities"]["object"] == "duplex.capabilities"
    assert rt.configs[0]["instructions"] == "Hi."  # the opener's config reached the runtime open
    assert_conformant(events)


@pytest.mark.parametrize(("selector", "kw"), [
    ("query", {"path": "/v1/realtime?beta=1"}),
    ("header", {"headers": {"OpenAI-Beta": "realtime=v1"}}),
])
async def test_beta_profile_names(selector: str, kw: dict) -> None:
    path = kw.get("path", "/v1/realtime")
    async with session(path=path, headers=kw.get("headers")) as (c, rt):
        rt.plan[1] = Speak("Hi", 500, end_of_turn=True)
        await stream_units(c, 2)
        await c.until("rate_limits.updated")
        events = await close(c)
    t = types(events)
    assert "response.audio.delta" in t and "response.audio_transcript.delta" in t
    assert "conversation.item.created" in t and "response.output_audio.delta" not in t
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["output"][0]["content"][0]["type"] == "audio"
    assert_conformant(events, "beta")


async def test_native_profile_folds_pairs_and_cancel() -> None:
    async with session(path="/v1/duplex", update={}) as (c, rt):
        rt.plan[1] = Speak("Hello ", 1000)
        rt.plan[2] = Speak("there", 1000)
        await stream_units(c, 2)
        got = await c.until("response.output_audio.delta")
        await c.send({"type": "output_audio_buffer.clear"})
        got += await c.until("audio.cancelled")
        await c.send({"type": "input_audio_buffer.commit"})
        got += await c.until("input.committed")
        events = await close(c)
    t = types(events)
    assert "response.speak" not in t and "response.output_audio_transcript.delta" not in t
    assert "conversation.item.added" not in t and "rate_limits.updated" not in t
    delta = next(e for e in got if e["type"] == "response.output_audio.delta")
    assert delta["model_speak"] is True and delta["audio_transcript"] == "Hello " and delta["format"] == "wav"
    assert t.index("output.cleared") < t.index("audio.cancelled")
    cancelled = next(e for e in got if e["type"] == "audio.cancelled")
    assert cancelled["reason"] == "output_cleared" and cancelled["transcript"] == "Hello "
    committed = next(e for e in got if e["type"] == "input.committed")
    assert committed["reason"] == "committed" and "history_len" in committed
    seqs = [e["server_event_seq"] for e in events if "server_event_seq" in e]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_http_routes() -> None:
    rt = FakeRuntime()
    async with serve(rt) as addr, httpx.AsyncClient(base_url=f"http://{addr}") as h:
        assert (await h.get("/health")).json() == {"status": "ok"}
        r = await h.get("/ready")
        assert r.status_code == 200 and r.json()["checks"]["models"] == {"duplex": True}
        models = (await h.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "openbmb/MiniCPM-o-4_5"
        caps = (await h.get("/v1/duplex/capabilities")).json()
        assert caps["active_sessions"] == 0 and caps["limits"]["max_sessions"] == 1
        assert caps["supports_barge_in"] is True and caps["chunk_period_ms"] == 1000
        assert "duplex_session_limit 1" in (await h.get("/metrics")).text
        rt.ready = False
        import asyncio

        await asyncio.sleep(1.05)  # readiness is cached for <= 1 s (§11.3)
        r = await h.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "not_ready" and r.json()["reasons"]
        assert (await h.get("/health")).status_code == 200  # liveness never depends on Triton


def test_settings_from_env() -> None:
    from gateway.settings import GatewaySettings

    s = GatewaySettings.from_env({"DUPLEX_TRITON_URL": "triton:9001", "DUPLEX_MAX_SESSIONS": "4",
                                  "DUPLEX_VOICES": "a,b", "DUPLEX_IDLE_TTL_S": "null", "OTHER": "x"})
    assert (s.triton_url, s.max_sessions, s.voices, s.idle_ttl_s) == ("triton:9001", 4, ("a", "b"), None)
    assert GatewaySettings.from_env({}).triton_url == "localhost:8001"
    with pytest.raises(ValueError):
        GatewaySettings.from_env({"DUPLEX_MAX_SESSIONS": "0"})
    assert json.dumps(s.limits_json())


async def test_beta_subprotocol_is_echoed_and_api_key_ignored() -> None:
    rt = FakeRuntime()
    protos = ["realtime", "openai-insecure-api-key.sk-test", "openai-beta.realtime-v1"]
    async with serve(rt) as addr, connect(addr, headers={"Authorization": "Bearer sk-test"},
                                          subprotocols=protos) as c:  # type: ignore[arg-type]
        assert c.ws.subprotocol == "realtime"  # the first one the gateway recognises
        created = await c.recv()
        rt.plan[1] = Speak("Hi", 500, end_of_turn=True)
        await stream_units(c, 2)
        got = await c.until("rate_limits.updated")
    assert created["type"] == "session.created"
    assert "response.audio.delta" in types(got)  # the beta selector in the subprotocol list picks `beta`


@pytest.mark.parametrize("deflate", [False, True])
async def test_permessage_deflate_is_accepted_only_when_set(deflate: bool) -> None:
    """The client offers permessage-deflate (websockets does by default); the gateway declines it unless
    `ws_per_message_deflate` is on (settings.py: base64 speech barely compresses, deflate costs the loop's core)."""
    async with serve(FakeRuntime(), ws_per_message_deflate=deflate) as addr, connect(addr, "/v1/realtime") as c:
        offered = c.ws.request.headers.get("Sec-WebSocket-Extensions") or ""
        accepted = c.ws.response.headers.get("Sec-WebSocket-Extensions") or ""
        assert "permessage-deflate" in offered
        assert ("permessage-deflate" in accepted) is deflate
        assert (await c.recv())["type"] == "session.created"  # the session works either way


@pytest.mark.parametrize(("env", "expected"), [(None, False), ("1", True), ("false", False)])
def test_the_serving_entry_point_takes_the_deflate_setting(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                           expected: bool) -> None:
    """`python -m gateway.serving` (what `duplex serve` runs) builds uvicorn from DUPLEX_WS_PER_MESSAGE_DEFLATE."""
    if env is None:
        monkeypatch.delenv("DUPLEX_WS_PER_MESSAGE_DEFLATE", raising=False)
    else:
        monkeypatch.setenv("DUPLEX_WS_PER_MESSAGE_DEFLATE", env)
    assert build("127.0.0.1", 0, "warning").config.ws_per_message_deflate is expected
