"""Run the gateway under uvicorn with a graceful drain: `python -m gateway.serving --host H --port P`.

Plain uvicorn closes every WebSocket (1012) before the app's lifespan shutdown runs, so sessions could not say
goodbye. `DrainingServer` first drains the gateway (`gateway.app.drain`: `session.closed{shutdown}`, close
1001, /ready red, new sessions refused), then lets uvicorn shut down as usual.
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import uvicorn

from gateway.app import create_app, drain  # drain: re-exported, the app drains in its lifespan too
from gateway.observability import redact_server_logs
from gateway.settings import GatewaySettings
from gateway.state import GatewayState

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: GatewayState) -> None:
        super().__init__(config)
        self.gateway_state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await drain(self.gateway_state)
        await super().shutdown(sockets)


def uvicorn_config(app: Any, settings: GatewaySettings, **kw: Any) -> uvicorn.Config:
    """uvicorn's configuration with the gateway's WebSocket transport settings (`kw`: host, port, log level)."""
    return uvicorn.Config(app, lifespan="on", ws_max_size=settings.ws_max_message_bytes,
                          ws_per_message_deflate=settings.ws_per_message_deflate, **kw)


def build(host: str, port: int, log_level: str = "info") -> DrainingServer:
    settings = GatewaySettings.from_env()
    app = create_app(settings.model_copy(update={"bind_host": host}))  # auth policy follows the real bind
    state: GatewayState = app.state.gateway
    config = uvicorn_config(app, state.settings, host=host, port=port, log_level=log_level)
    redact_server_logs()  # after uvicorn.Config, which (re)configures uvicorn's loggers
    return DrainingServer(config, state)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    build(args.host, args.port, args.log_level).run()


if __name__ == "__main__":
    main()
