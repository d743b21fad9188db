from __future__ import annotations

import hmac

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from gateway import auth as auth_mod
from gateway.auth import (
    AuthConfig,
    AuthConfigError,
    Authenticator,
    HttpAuthMiddleware,
    is_loopback,
    select_subprotocol,
)
from gateway.protocol.errors import ProtocolError, error_event, handshake_close_code

KEY = "sk-test-0123456789"


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False), ("10.1.2.3", False),
                                            ("example.com", False)])
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_policy_off_on_loopback_required_with_key() -> None:
    assert not AuthConfig.build("127.0.0.1").required
    assert AuthConfig.build("127.0.0.1", [KEY]).required
    assert AuthConfig.build("0.0.0.0", [KEY]).required
    assert KEY not in repr(AuthConfig.build("0.0.0.0", [KEY]))


def test_no_key_configured_accepts_anything() -> None:
    a = Authenticator(AuthConfig.build("127.0.0.1"))
    a.check_http({})
    assert a.check_websocket({}, ["realtime"]) == "realtime"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope"}, {"authorization": KEY},
                                     {"authorization": f"Basic {KEY}"}, {"authorization": "Bearer "}])
def test_bad_http_keys(headers: dict[str, str]) -> None:
    a = Authenticator(AuthConfig.build("0.0.0.0", [KEY]))
    with pytest.raises(ProtocolError) as ei:
        a.check_http(headers)
    assert ei.value.code == "invalid_api_key"
    assert handshake_close_code(ei.value.code) == 1008


def test_good_keys_any_of_several() -> None:
    a = Authenticator(AuthConfig.build("0.0.0.0", ["other", KEY]))
    a.check_http({"authorization": f"Bearer {KEY}"})
    a.check_http({"authorization": f"bearer   {KEY}"})
    assert a.check_websocket({}, ["realtime", f"openai-insecure-api-key.{KEY}"]) == "realtime"
    assert a.check_websocket({"authorization": f"Bearer {KEY}"}, []) is None


def test_compare_is_constant_time_over_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hmac.compare_digest

    def spy(x: bytes, y: bytes) -> bool:
        calls.append(1)
        return real(x, y)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", spy)
    a = Authenticator(AuthConfig.build("0.0.0.0", [KEY, "second", "third"]))
    assert a.key_ok(KEY)
    assert len(calls) == 3  # no early exit on the first match


def test_subprotocol_echo_never_the_key() -> None:
    offered = [f"openai-insecure-api-key.{KEY}", "openai-beta.realtime-v1", "realtime"]
    assert select_subprotocol(offered) == "openai-beta.realtime-v1"
    assert select_subprotocol([f"openai-insecure-api-key.{KEY}"]) is None


def test_origin_allow_list() -> None:
    a = Authenticator(AuthConfig.build("127.0.0.1", [], ["https://app.example.com/"]))
    a.check_http({"origin": "https://APP.example.com"})
    a.check_http({})  # non-browser clients send no Origin
    with pytest.raises(ProtocolError) as ei:
        a.check_websocket({"origin": "https://evil.example"}, ["realtime"])
    assert ei.value.code == "origin_not_allowed"
    Authenticator(AuthConfig.build("127.0.0.1", [], ["*"])).check_http({"origin": "https://x"})


def make_app(auth: Authenticator) -> FastAPI:
    """A stand-in for the gateway routes, wired as docs/gateway_ops_wiring.md describes."""
    app = FastAPI()
    app.add_middleware(HttpAuthMiddleware, authenticator=auth)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"object": "list"}

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        headers = {k.lower(): v for k, v in ws.headers.items()}
        try:
            echo = auth.check_websocket(headers, offered)
        except ProtocolError as err:
            await ws.accept(subprotocol=select_subprotocol(offered))
            await ws.send_json(error_event(err, None))
            await ws.close(code=int(handshake_close_code(err.code)), reason=err.code)
            return
        await ws.accept(subprotocol=echo)
        await ws.send_json({"type": "session.created"})
        await ws.close()

    return app


def test_http_middleware() -> None:
    client = TestClient(make_app(Authenticator(AuthConfig.build("0.0.0.0", [KEY]))))
    assert client.get("/health").status_code == 200  # probes stay public
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_websocket_browser_subprotocol_and_rejection() -> None:
    client = TestClient(make_app(Authenticator(AuthConfig.build("0.0.0.0", [KEY]))))
    with client.websocket_connect("/v1/realtime", subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        assert ws.accepted_subprotocol == "realtime"
        assert ws.receive_json()["type"] == "session.created"
    with client.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    with client.websocket_connect("/v1/realtime", subprotocols=["realtime", "openai-insecure-api-key.bad"]) as ws:
        assert ws.accepted_subprotocol == "realtime"
        ev = ws.receive_json()
        assert ev["type"] == "error" and ev["error"]["code"] == "invalid_api_key"
        assert ev["error"]["type"] == "invalid_request_error" and ev["error"]["retryable"] is False
        with pytest.raises(WebSocketDisconnect) as ei:
            ws.receive_json()
        assert ei.value.code == 1008 and ei.value.reason == "invalid_api_key"


@pytest.mark.parametrize(("bind", "keys", "mode"), [
    ("0.0.0.0", [], "auto"),  # beyond loopback without a key: refuse to start
    ("127.0.0.1", [], "required"),
    ("127.0.0.1", [KEY], "off"),  # a configured key must never be silently unused
    ("127.0.0.1", [], "sometimes"),
])
def test_unsafe_or_inconsistent_auth_settings_stop_startup(bind: str, keys: list[str], mode: str) -> None:
    with pytest.raises(AuthConfigError, match="DUPLEX_"):
        AuthConfig.build(bind, keys, (), mode)


def test_auth_off_serves_without_key_on_any_bind() -> None:
    assert not AuthConfig.build("0.0.0.0", [], (), "off").required


def test_foreign_browser_origin_is_refused_by_default_but_own_origin_passes() -> None:
    a = Authenticator(AuthConfig.build("127.0.0.1"))
    a.check_http({"origin": "http://127.0.0.1:8000", "host": "127.0.0.1:8000"})  # the demo page
    a.check_http({"host": "127.0.0.1:8000"})  # SDKs send no Origin
    for origin in ("https://evil.example", "null"):
        with pytest.raises(ProtocolError) as err:
            a.check_websocket({"origin": origin, "host": "127.0.0.1:8000"}, ["realtime"])
        assert err.value.code == "origin_not_allowed"
