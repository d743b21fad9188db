"""Wire format of the `duplex` pipeline (notes/triton_contract.md): request tensors and response events.

Pure functions, so the encoding is tested without a server. With `batch_dim` every tensor gets a leading
batch dimension of 1, as Triton requires for a model with `max_batch_size >= 1` (sequence batching).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput

from gateway.runtime.base import (
    AudioPiece,
    Decision,
    Fence,
    RuntimeEvent,
    StreamError,
    TextPiece,
    UnitDone,
    UnitSubmission,
)

OUTPUTS = ("EVENT", "AUDIO")
STAGE_OUTPUTS = ("EVENT", "AUDIO", "TOKENS", "HIDDEN")  # a stage's payload events carry TOKENS / HIDDEN
CONTROL_EVENTS = frozenset({"opened", "updated", "cancelled", "closed"})


def _tensor(name: str, arr: np.ndarray, dtype: str, batch_dim: bool) -> InferInput:
    data = arr[None, ...] if batch_dim else arr
    t = InferInput(name, list(data.shape), dtype)
    t.set_data_from_numpy(data)
    return t


def _fence(f: Fence) -> np.ndarray:
    return np.array([f.incarnation, f.epoch, f.append_seq], dtype=np.int64)


def build_request(model: str, correlation_id: int, request_id: str, op: str, fence: Fence, *, batch_dim: bool,
                  next_fence: Fence | None = None, unit: UnitSubmission | None = None,
                  config: Mapping[str, Any] | None = None, tokens: np.ndarray | None = None,
                  hidden: np.ndarray | None = None, outputs: tuple[str, ...] = OUTPUTS) -> dict[str, Any]:
    """One `stream_infer` request dict for a fenced operation (`tokens` / `hidden`: a stage's payload)."""
    inputs = [_tensor("OP", np.array([op.encode()], dtype=np.object_), "BYTES", batch_dim),
              _tensor("FENCE", _fence(fence), "INT64", batch_dim)]
    if next_fence is not None:
        inputs.append(_tensor("NEXT_FENCE", _fence(next_fence), "INT64", batch_dim))
    if unit is not None:
        inputs.append(_tensor("PCM", np.frombuffer(unit.pcm, dtype="<f4").astype(np.float32), "FP32", batch_dim))
        if unit.frames:
            inputs.append(_tensor("FRAMES", np.array(list(unit.frames), dtype=np.object_), "BYTES", batch_dim))
        inputs.append(_tensor("FORCE_LISTEN", np.array([unit.force_listen], dtype=bool), "BOOL", batch_dim))
        if unit.temperature is not None and config is None:
            config = unit_config(unit)
    if tokens is not None:
        inputs.append(_tensor("TOKENS", np.asarray(tokens, dtype=np.int64).reshape(-1), "INT64", batch_dim))
    if hidden is not None:
        inputs.append(_tensor("HIDDEN", np.asarray(hidden, dtype=np.float32).reshape(-1), "FP32", batch_dim))
    if config is not None:
        inputs.append(_tensor("CONFIG", np.array([json.dumps(config).encode()], dtype=np.object_), "BYTES",
                              batch_dim))
    return {"model_name": model, "inputs": inputs, "outputs": [InferRequestedOutput(n) for n in outputs],
            "request_id": request_id, "sequence_id": correlation_id, "sequence_start": op == "open",
            "sequence_end": op == "close",
            # Decoupled model: ask for the flagged empty final response that acknowledges each request.
            "parameters": {"triton_enable_empty_final_response": True}}


def unit_config(unit: UnitSubmission) -> dict[str, Any]:
    """An append's CONFIG (docs/triton.md): only the unit's own thinker temperature, when it has one."""
    return {"thinker": {"temperature": unit.temperature}}


def parse_event(raw: bytes | str, audio: np.ndarray | None, epoch: int) -> RuntimeEvent | dict[str, Any]:
    """One EVENT (+AUDIO) -> a typed runtime event, or the raw dict for control/error events."""
    return typed_event(json.loads(raw), audio, epoch)


def as_unit(ev: RuntimeEvent | dict[str, Any], unit: int) -> RuntimeEvent | dict[str, Any]:
    """An event of an append's response stream, labelled with the unit index that append submitted (a control dict
    as it is). Stage0 numbers the units it accepted, the gateway the units it cut: after an append fenced off by a
    cancel (protocol.md §4.4 F-4) they differ, and the session pairs decisions, text and audio by its own numbers
    (A-4)."""
    if getattr(ev, "unit", unit) == unit:
        return ev
    return dataclasses.replace(ev, unit=unit)  # type: ignore[type-var] - every event with a `unit` is a dataclass


def typed_event(ev: dict[str, Any], audio: np.ndarray | None, epoch: int) -> RuntimeEvent | dict[str, Any]:
    """`parse_event` for an EVENT already decoded."""
    kind = ev.get("type")
    if kind == "decision":
        return Decision(epoch=epoch, unit=int(ev["unit"]), action=ev["action"], forced=bool(ev.get("forced", False)))
    if kind == "text":
        # parsed as the response arrives: its receipt on this clock, next to the engine's sampling stamp (P13)
        sampled = ev.get("sampled_at")
        return TextPiece(epoch=epoch, unit=int(ev["unit"]), text=ev.get("text", ""), token_id=ev.get("token_id"),
                         sampled_at=float(sampled) if isinstance(sampled, (int, float)) else None,
                         received_at=time.monotonic())
    if kind == "audio":
        pcm = b"" if audio is None else np.asarray(audio, dtype="<i2").reshape(-1).tobytes()
        last = ev.get("last")
        return AudioPiece(epoch=epoch, unit=int(ev["unit"]), seq=int(ev.get("seq", 0)), pcm16=pcm,
                          last=bool(last) if last is not None else None)
    if kind == "unit_done":
        return UnitDone(epoch=epoch, unit=int(ev["unit"]), is_listen=bool(ev["is_listen"]),
                        end_of_turn=bool(ev.get("end_of_turn", False)), metrics=ev.get("metrics") or {},
                        forced=bool(ev.get("forced", False)))
    if kind in CONTROL_EVENTS or kind == "error":
        return ev
    return StreamError(epoch=epoch, code="runtime_contract_invalid", message=f"unknown runtime event {kind!r}")
