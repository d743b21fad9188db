"""The gateway's gRPC client for Triton, with reconnects bounded for a server that restarts.

gRPC's default reconnect backoff grows to two minutes: after tritonserver restarted (the launcher supervises
it), the gateway's channel stayed in TRANSIENT_FAILURE, so `/ready` stayed 503 and new sessions were refused
long after Triton was back. The channel here retries every 0.2-2 s instead.
"""

from __future__ import annotations

from typing import Any

from gateway.runtime.base import Readiness

RECONNECT_BACKOFF_MS = (200, 2000)  # first / longest wait between reconnect attempts


def channel_args() -> list[tuple[str, Any]]:
    """tritonclient's default channel arguments plus the bounded reconnect backoff."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions  # noqa: PLC0415 - only when serving

    keep = KeepAliveOptions()
    first, longest = RECONNECT_BACKOFF_MS
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keep.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keep.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keep.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keep.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", first),
            ("grpc.min_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", longest)]


def triton_client(url: str) -> Any:
    """A `tritonclient.grpc.aio.InferenceServerClient`; create it on the event loop that uses it."""
    from tritonclient.grpc.aio import InferenceServerClient  # noqa: PLC0415

    return InferenceServerClient(url, channel_args=channel_args())


async def probe_readiness(client: Any, models: tuple[str, ...]) -> Readiness:
    """Server live/ready and each model ready; an unreachable Triton is "not ready", with the reason."""
    try:
        live = await client.is_server_live()
        ready = await client.is_server_ready()
        states = {m: bool(await client.is_model_ready(m)) for m in models}
    except Exception as exc:  # noqa: BLE001 - any failure to answer means not ready
        return Readiness(False, False, dict.fromkeys(models, False), (f"triton: {exc}",))
    reasons = tuple(f"model {m} not ready" for m, ok in states.items() if not ok)
    return Readiness(live, ready, states, reasons)
