"""The `duplex` console script: `duplex serve ...` (tritonserver + gateway) and `duplex talk ...` (the client CLI)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUBCOMMANDS = ("serve", "talk")


def _serve(argv: list[str]) -> int:
    from serve.launcher import (  # noqa: PLC0415
        DEFAULT_CACHE_DIR,
        REPO_ROOT,
        ServeOptions,
        TritonPorts,
        choose_triton_ports,
        serve,
    )

    ap = argparse.ArgumentParser(prog="duplex serve",
                                 description="Serve MiniCPM-o 4.5 full-duplex: tritonserver + the gateway.")
    ap.add_argument("--port", type=int, default=8000, help="gateway HTTP/WebSocket port (default 8000)")
    ap.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="checkpoint directory (default: the tiny checkpoint, generated if missing)")
    ap.add_argument("--profile", type=Path, default=REPO_ROOT / "deploy" / "profiles" / "default.yaml",
                    help="deploy profile YAML (default deploy/profiles/default.yaml)")
    ap.add_argument("--max-sessions", type=int, default=None, help="override the profile's max_sessions")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                    help="where the tiny checkpoint, the generated repository and logs go")
    ap.add_argument("--only", choices=("triton", "gateway"), default=None,
                    help="run one half (the two containers of docker-compose.yml); default both")
    ap.add_argument("--triton-host", default="127.0.0.1", help="Triton bind address (default 127.0.0.1)")
    ap.add_argument("--triton-http-port", type=int, default=None, help="default: --port + 1, or a free port")
    ap.add_argument("--triton-grpc-port", type=int, default=None, help="default: --port + 2, or a free port")
    ap.add_argument("--triton-metrics-port", type=int, default=None, help="default: --port + 3, or a free port")
    ap.add_argument("--triton-url", default=None, help="--only gateway: Triton gRPC address (host:port)")
    args = ap.parse_args(argv)
    if args.only == "gateway" and not args.triton_url:
        ap.error("--only gateway needs --triton-url")
    given = (args.triton_http_port, args.triton_grpc_port, args.triton_metrics_port)
    ports = None  # the launcher derives them from --port (or picks free ones)
    if any(given):
        auto = choose_triton_ports(args.port)
        ports = TritonPorts(http=given[0] or auto.http, grpc=given[1] or auto.grpc, metrics=given[2] or auto.metrics)
    return serve(ServeOptions(port=args.port, host=args.host, checkpoint=args.checkpoint, profile=args.profile,
                              max_sessions=args.max_sessions, cache_dir=args.cache_dir, only=args.only,
                              triton_host=args.triton_host, triton_ports=ports, triton_url=args.triton_url))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: duplex {{{','.join(SUBCOMMANDS)}}} ...\n  serve  start tritonserver and the gateway "
              "(duplex serve --help)\n  talk   stream a WAV to a gateway, save the replies (duplex talk --help)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command == "talk":
        from clients.cli import talk_main  # noqa: PLC0415 - the client imports neither gateway nor engine

        return talk_main(rest)
    print(f"duplex: unknown subcommand {command!r} (known: {', '.join(SUBCOMMANDS)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
