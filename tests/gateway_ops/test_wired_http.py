"""Auth (issue 9), the web demo at `/`, capabilities and /metrics, through the real app over real sockets."""

from __future__ import annotations

import websockets

from gateway.app import DEFAULT_WEB_ROOT
from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import append, serve
from tests.gateway_ops.test_wired_resume import stream
from tests.gateway_ops.wire import http_get, metric, opened, raw

KEY = "sk-test-0123456789"


async def test_auth_off_on_loopback_by_default() -> None:
    async with serve(FakeRuntime()) as addr:
        c, created = await opened(addr)
        assert created["type"] == "session.created"
        await c.ws.close()
        assert (await http_get(addr, "/v1/models")).status_code == 200


async def scenario_key_required(addr: str, key: str) -> None:
    async with raw(addr) as c:  # no key: typed handshake error, 1008
        err = await c.recv()
        assert err["error"]["code"] == "invalid_api_key" and await c.closed() == (1008, "invalid_api_key")
    async with raw(addr, additional_headers={"Authorization": "Bearer wrong"}) as c:
        assert (await c.recv())["error"]["code"] == "invalid_api_key"
    async with raw(addr, additional_headers={"Authorization": f"Bearer {key}"}) as c:
        assert (await c.recv())["type"] == "session.created"
    # the browser form: the key rides in a subprotocol; the server echoes `realtime`, never the key entry
    async with raw(addr, subprotocols=["realtime", f"openai-insecure-api-key.{key}"]) as c:  # type: ignore[list-item]
        assert c.ws.subprotocol == "realtime" and (await c.recv())["type"] == "session.created"
    async with raw(addr, subprotocols=["realtime", "openai-insecure-api-key.nope"]) as c:  # type: ignore[list-item]
        assert c.ws.subprotocol == "realtime" and (await c.recv())["error"]["code"] == "invalid_api_key"
    models = await http_get(addr, "/v1/models")
    assert models.status_code == 401 and models.json()["error"]["code"] == "invalid_api_key"
    assert (await http_get(addr, "/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == 200
    for public in ("/health", "/ready", "/metrics"):
        assert (await http_get(addr, public)).status_code == 200


async def test_key_required_when_configured() -> None:
    async with serve(FakeRuntime(), api_keys=(KEY, "sk-other"), max_sessions=8) as addr:
        await scenario_key_required(addr, KEY)


async def test_origin_allow_list() -> None:
    async with serve(FakeRuntime(), allowed_origins=("https://app.example",), max_sessions=8) as addr:
        async with raw(addr, origin="https://evil.example") as c:  # type: ignore[arg-type]
            assert (await c.recv())["error"]["code"] == "origin_not_allowed"
            assert await c.closed() == (1008, "origin_not_allowed")
        async with raw(addr, origin="https://app.example") as c:  # type: ignore[arg-type]
            assert (await c.recv())["type"] == "session.created"
        async with raw(addr) as c:  # no Origin: not a browser
            assert (await c.recv())["type"] == "session.created"
        bad = await http_get(addr, "/v1/duplex/capabilities", headers={"Origin": "https://evil.example"})
        assert bad.status_code == 403


async def test_web_demo_served_at_root() -> None:
    async with serve(FakeRuntime()) as addr:
        page = await http_get(addr, "/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert page.text == (DEFAULT_WEB_ROOT / "index.html").read_text()
        assert (await http_get(addr, "/app.js")).status_code == 200
        assert (await http_get(addr, "/health")).json() == {"status": "ok"}  # routes win over the mount
    async with serve(FakeRuntime(), web_root="") as addr:
        assert (await http_get(addr, "/")).status_code == 404


async def test_capabilities_claim_what_is_wired() -> None:
    async with serve(FakeRuntime()) as addr:
        caps = (await http_get(addr, "/v1/duplex/capabilities")).json()
        c, created = await opened(addr)
        await c.ws.close()
    assert caps["supports_session_resume"] is True and caps["supports_session_lease"] is True
    assert caps["supports_server_vad"] is True and caps["turn_detection"] == ["server_vad"]
    session_caps = created["session"]["capabilities"]
    assert {k: v for k, v in caps.items() if k != "active_sessions"} == session_caps
    assert created["resume_token"]  # §2.9: present iff supports_session_resume


async def test_metrics_exposition() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("metered ", 1000, end_of_turn=True)
    async with serve(rt) as addr:
        c, _ = await opened(addr)
        await stream(c, 2)
        await c.until("response.done")
        await c.ws.send(b"\x00binary")
        await c.send(append(100))
        await c.send({"type": "session.close"})
        await c.until("session.closed")
        await c.ws.close()
        resp = await http_get(addr, "/metrics")
    text = resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert metric(text, "duplex_session_limit") == 1
    assert metric(text, "duplex_sessions", state="open") == 0 and metric(text, "duplex_sessions", state="closing") == 0
    assert metric(text, "duplex_input_appends_total") == 12  # 11 to complete two units, one more
    assert metric(text, "duplex_audio_output_seconds_total") == 1.0
    assert metric(text, "duplex_sessions_ended_total", reason="client_close") == 1
    assert metric(text, "duplex_ignored_binary_frames_total") == 1
    assert metric(text, "duplex_response_created_to_first_audio_seconds_count") == 1
    assert metric(text, "duplex_model_unit_seconds_count") >= 2
    assert metric(text, "duplex_unit_to_first_audio_seconds_count") == 1
    assert metric(text, "duplex_responses_total", status="completed", reason="turn_end") == 1


async def test_ws_refusal_keeps_socket_protocol_for_bad_params_too() -> None:
    async with serve(FakeRuntime(), api_keys=(KEY,)) as addr:
        async with websockets.connect(f"ws://{addr}/v1/realtime?duplex=0",
                                      additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert '"unsupported"' in str(await ws.recv())


def test_settings_from_env() -> None:
    from gateway.settings import GatewaySettings  # noqa: PLC0415

    s = GatewaySettings.from_env({"DUPLEX_API_KEYS": "k1,k2", "DUPLEX_ALLOWED_ORIGINS": "https://a.example",
                                  "DUPLEX_WEB_ROOT": "", "DUPLEX_BIND_HOST": "0.0.0.0", "DUPLEX_MAX_SESSIONS": "3"})
    assert (s.api_keys, s.allowed_origins, s.web_root, s.bind_host, s.max_sessions) == (
        ("k1", "k2"), ("https://a.example",), "", "0.0.0.0", 3)
    assert GatewaySettings.from_env({}).api_keys == ()
