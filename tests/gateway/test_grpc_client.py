"""The gateway's Triton channel reconnects within seconds after tritonserver restarts (gateway/runtime/grpc_client.py)."""

from __future__ import annotations

from gateway.runtime.grpc_client import channel_args


def test_reconnect_backoff_is_bounded_and_the_defaults_stay() -> None:
    args = dict(channel_args())
    assert args["grpc.max_reconnect_backoff_ms"] <= 2000  # gRPC's default grows to 120 s
    assert args["grpc.initial_reconnect_backoff_ms"] <= args["grpc.max_reconnect_backoff_ms"]
    assert args["grpc.max_receive_message_length"] >= 2**31 - 1  # tritonclient's default message limit kept
    assert "grpc.keepalive_time_ms" in args
