"""API-key authentication and the browser origin allow-list (issue 9).

A key arrives as `Authorization: Bearer <key>` (SDKs, servers) or, from browsers that cannot set headers,
as the WebSocket subprotocol `openai-insecure-api-key.<key>` next to `realtime` (OpenAI's browser form:
`["realtime", "openai-insecure-api-key.KEY"]`). The server then echoes `realtime` (or the beta selector),
never the key-bearing entry. Keys are compared in constant time over SHA-256 digests, so neither content
nor length leaks through timing.

Policy: off by default when bound to loopback; required as soon as a key is configured. Without a key, a
request must name this server by a loopback name, an IP literal or a configured host (`Host` header): a page
on `evil.example` that re-resolves its name to 127.0.0.1 (DNS rebinding) sends `Host: evil.example` and a
matching `Origin`, so the origin check alone would let it drive a key-less loopback server. protocol.md §1.1
leaves authentication to deployments and defines no code for it, so a refusal uses OpenAI's code
`invalid_api_key` (HTTP 401) and `origin_not_allowed` (HTTP 403); on a WebSocket both are handshake errors
(error event, then close 1008, §1.8: a client-caused handshake error). Unknown to a client, they read as
non-retryable `invalid_request_error` (§1.6).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.protocol.errors import Effect, ProtocolError

log = logging.getLogger(__name__)

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
ECHO_SUBPROTOCOLS = ("realtime", "openai-beta.realtime-v1")
PUBLIC_HTTP_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no key
HTTP_STATUS = {"invalid_api_key": 401, "origin_not_allowed": 403, "host_not_allowed": 403}
AUTH_MODES = ("auto", "required", "off")


class AuthConfigError(ValueError):
    """The auth settings cannot serve safely; startup stops with this message (it names the variable)."""


def host_name(host_header: str) -> str:
    """`Host` header -> lower-case name or IP literal, without the port (`[::1]:8000` -> `::1`)."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    allowed_origins: tuple[str, ...] = ()  # exact `scheme://host[:port]` besides our own; "*" = any origin
    required: bool = False
    allowed_hosts: tuple[str, ...] = ()  # DNS names a key-less server answers to besides localhost; "*" = any

    @classmethod
    def build(cls, bind_host: str, api_keys: Iterable[str] = (), allowed_origins: Iterable[str] = (),
              mode: str = "auto", allowed_hosts: Iterable[str] = ()) -> AuthConfig:
        """`mode` (DUPLEX_AUTH): `auto` requires a key when one is configured and refuses to start
        without one on a non-loopback bind; `required` always needs a key; `off` serves without
        authentication on purpose (refused if a key is configured, so a key is never silently unused)."""
        keys = tuple(k for k in api_keys if k)
        if mode not in AUTH_MODES:
            raise AuthConfigError(f"DUPLEX_AUTH: expected one of {AUTH_MODES}, got {mode!r}")
        if mode == "off":
            if keys:
                raise AuthConfigError("DUPLEX_AUTH=off but DUPLEX_API_KEYS is set: remove one of them")
            log.warning("authentication is off (DUPLEX_AUTH=off) on %s", bind_host)
        elif not keys and (mode == "required" or not is_loopback(bind_host)):
            raise AuthConfigError(
                f"no API key configured while bound to {bind_host}: set DUPLEX_API_KEYS, "
                "or DUPLEX_AUTH=off to serve without authentication on purpose")
        origins = tuple(o.rstrip("/").lower() for o in allowed_origins if o)
        hosts = tuple(h.strip().lower() for h in allowed_hosts if h.strip())
        return cls(keys, origins, required=bool(keys), allowed_hosts=hosts)


def _error(code: str, message: str) -> ProtocolError:
    return ProtocolError(code, message, effect=Effect.HANDSHAKE)


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """`headers` keys lower-case. Returns the token of `Authorization: Bearer <token>`."""
    value = headers.get("authorization", "")
    scheme, _, token = value.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def subprotocol_key(subprotocols: Sequence[str]) -> str | None:
    for p in subprotocols:
        if p.startswith(KEY_SUBPROTOCOL_PREFIX) and len(p) > len(KEY_SUBPROTOCOL_PREFIX):
            return p[len(KEY_SUBPROTOCOL_PREFIX):]
    return None


def select_subprotocol(subprotocols: Sequence[str]) -> str | None:
    """The subprotocol to echo: the first offered known one; never the key-bearing entry."""
    return next((p for p in subprotocols if p in ECHO_SUBPROTOCOLS), None)


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in config.api_keys)

    def key_ok(self, presented: str | None) -> bool:
        if not self.config.required:
            return True
        if presented is None:
            return False
        d = hashlib.sha256(presented.encode()).digest()
        ok = False
        for ref in self._digests:  # no early exit: every configured key is compared
            ok |= hmac.compare_digest(d, ref)
        return ok

    def origin_ok(self, origin: str | None, host: str | None = None) -> bool:
        """Browsers: the gateway's own origin (the demo page) or a listed one; `*` allows any.
        Non-browser clients send no Origin. Checked even without keys, so that a key-less loopback
        gateway cannot be driven by another web page open in the same browser."""
        allowed = self.config.allowed_origins
        if origin is None or "*" in allowed:
            return True
        origin = origin.rstrip("/").lower()
        if host and origin.partition("://")[2] == host.lower():
            return True
        return origin in allowed

    def host_ok(self, host: str | None) -> bool:
        """With a key, any Host (the key is the guard). Without one: an IP literal (no name to rebind),
        `localhost` or a name under it, or a configured name. No Host header at all (HTTP/1.0) is no name."""
        if self.config.required or host is None or "*" in self.config.allowed_hosts:
            return True
        name = host_name(host)
        return (is_ip_literal(name) or name == "localhost" or name.endswith(".localhost")
                or name in self.config.allowed_hosts)

    def _check_host(self, headers: Mapping[str, str]) -> None:
        if not self.host_ok(headers.get("host")):
            raise _error("host_not_allowed", "this server has no API key and answers only to loopback host names; "
                         "add the name to DUPLEX_ALLOWED_HOSTS or configure DUPLEX_API_KEYS")

    def check_http(self, headers: Mapping[str, str]) -> None:
        """Raises ProtocolError(host_not_allowed | invalid_api_key | origin_not_allowed). Keys lower-case."""
        self._check_host(headers)
        if not self.origin_ok(headers.get("origin"), headers.get("host")):
            raise _error("origin_not_allowed", "origin not allowed")
        if not self.key_ok(bearer_key(headers)):
            raise _error("invalid_api_key", "missing or invalid API key")

    def check_websocket(self, headers: Mapping[str, str], subprotocols: Sequence[str]) -> str | None:
        """WebSocket upgrade: header or subprotocol key. Returns the subprotocol to echo (or None)."""
        self._check_host(headers)
        if not self.origin_ok(headers.get("origin"), headers.get("host")):
            raise _error("origin_not_allowed", "origin not allowed")
        key = bearer_key(headers) or subprotocol_key(subprotocols)
        if not self.key_ok(key):
            raise _error("invalid_api_key", "missing or invalid API key")
        return select_subprotocol(subprotocols)


class HttpAuthMiddleware:
    """ASGI middleware for the HTTP routes (`app.add_middleware(HttpAuthMiddleware, authenticator=...)`).

    WebSocket scopes pass through: the route checks them with `check_websocket`, so that a refusal is a
    typed handshake error on the socket (§1.6) instead of a bare HTTP 403 from the upgrade.
    """

    def __init__(self, app, authenticator: Authenticator) -> None:  # noqa: ANN001 - any ASGI app
        self.app, self.auth = app, authenticator

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        # CORS preflights carry no credentials by design; they pass to the app (or its CORS middleware).
        if scope["type"] != "http" or scope.get("path") in PUBLIC_HTTP_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            self.auth.check_http(headers)
        except ProtocolError as err:
            from starlette.responses import JSONResponse  # noqa: PLC0415 - keeps the checks free of starlette

            body = {"error": {"type": "invalid_request_error", "code": err.code, "message": err.message,
                              "param": None}}
            extra = {"www-authenticate": "Bearer"} if err.code == "invalid_api_key" else None
            await JSONResponse(body, status_code=HTTP_STATUS[err.code], headers=extra)(scope, receive, send)
            return
        await self.app(scope, receive, send)
