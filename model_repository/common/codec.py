"""Typed stage requests/responses and their tensor form (numpy only, testable without Triton).

Every model (stage0, tts, token2wav, duplex) shares one input/output schema, see docs/triton.md.
With `max_batch_size >= 1` every tensor carries a leading batch dim of 1 on the wire; `get` callers
hand us the tensor as sent and we strip that dim here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

OPS = ("open", "append", "cancel", "update", "close")
FENCE_LEN = 3  # (incarnation, epoch, append_seq)
INPUT_NAMES = ("OP", "FENCE", "NEXT_FENCE", "PCM", "FRAMES", "FORCE_LISTEN", "CONFIG", "TOKENS", "HIDDEN")
OUTPUT_NAMES = ("EVENT", "AUDIO", "TOKENS", "HIDDEN")
# Request parameter a BLS caller sets to get every output of a request in ONE final response (see
# `coalesce` below and docs/triton.md): the pipeline's guard against the 2.51 stub's decoupled-BLS defect.
COALESCE_PARAMETER = "coalesce"
BATCH_EVENT = "batch"

Fence = tuple[int, int, int]


class RequestError(Exception):
    """A protocol error that belongs to one request: sent back as an `error` EVENT, then final."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class StageRequest:
    corrid: int
    op: str
    fence: Fence
    start: bool = False
    end: bool = False
    next_fence: Fence | None = None
    pcm: np.ndarray | None = None  # [samples] float32, 16 kHz mono
    frames: tuple[bytes, ...] = ()
    force_listen: bool | None = None
    config: dict[str, Any] | None = None
    tokens: np.ndarray | None = None  # [n] int64, stage-to-stage payload
    hidden: np.ndarray | None = None  # [n] float32, flattened stage-to-stage payload


@dataclass(frozen=True)
class StageOutput:
    event: dict[str, Any]
    audio: np.ndarray | None = None  # [samples] int16, 24 kHz mono
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def error_output(code: str, message: str) -> StageOutput:
    return StageOutput({"type": "error", "code": code, "message": message})


def _unbatch(arr: np.ndarray) -> np.ndarray:
    return arr[0] if arr.ndim >= 2 and arr.shape[0] == 1 else arr.reshape(-1)


def _fence(arr: np.ndarray | None, name: str) -> Fence | None:
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != FENCE_LEN:
        raise RequestError("invalid_request", f"{name} must hold {FENCE_LEN} int64 values, got {flat.size}")
    return (int(flat[0]), int(flat[1]), int(flat[2]))


def _text(arr: np.ndarray) -> str:
    item = np.asarray(arr).reshape(-1)[0]
    return item.decode() if isinstance(item, bytes) else str(item)


def parse_request(get: Callable[[str], np.ndarray | None], corrid: int, start: bool, end: bool) -> StageRequest:
    """Build a StageRequest from named tensors; raise RequestError with a typed code if malformed."""
    op_t = get("OP")
    if op_t is None:
        raise RequestError("invalid_request", "missing OP input")
    op = _text(op_t)
    if op not in OPS:
        raise RequestError("invalid_request", f"unknown OP {op!r}; expected one of {OPS}")
    fence = _fence(get("FENCE"), "FENCE")
    if fence is None:
        raise RequestError("invalid_request", "missing FENCE input")
    next_fence = _fence(get("NEXT_FENCE"), "NEXT_FENCE")
    if op == "cancel" and next_fence is None:
        raise RequestError("invalid_request", "cancel needs NEXT_FENCE")
    config = None
    if (cfg_t := get("CONFIG")) is not None:
        try:
            config = json.loads(_text(cfg_t) or "{}")
        except json.JSONDecodeError as exc:
            raise RequestError("invalid_runtime_config", f"CONFIG is not JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise RequestError("invalid_runtime_config", "CONFIG must be a JSON object")
    pcm = get("PCM")
    if pcm is not None:
        if pcm.dtype != np.float32:
            raise RequestError("bad_audio", f"PCM must be FP32, got {pcm.dtype}")
        pcm = _unbatch(pcm)
    frames_t, fl_t, tok_t, hid_t = get("FRAMES"), get("FORCE_LISTEN"), get("TOKENS"), get("HIDDEN")
    return StageRequest(
        corrid=corrid, op=op, fence=fence, start=start, end=end, next_fence=next_fence, pcm=pcm,
        frames=tuple(bytes(f) for f in frames_t.reshape(-1)) if frames_t is not None else (),
        force_listen=bool(np.asarray(fl_t).reshape(-1)[0]) if fl_t is not None else None,
        config=config,
        tokens=_unbatch(tok_t).astype(np.int64) if tok_t is not None else None,
        hidden=_unbatch(hid_t).astype(np.float32) if hid_t is not None else None,
    )


def output_arrays(out: StageOutput) -> dict[str, np.ndarray]:
    """The four output tensors of one response, batch dim 1 included; absent ones are empty."""
    event = json.dumps(out.event, separators=(",", ":")).encode()
    return {
        "EVENT": np.array([[event]], dtype=np.object_),
        "AUDIO": _batched(out.audio, np.int16),
        "TOKENS": _batched(out.tokens, np.int64),
        "HIDDEN": _batched(out.hidden, np.float32),
    }


def _batched(arr: np.ndarray | None, dtype: type) -> np.ndarray:
    if arr is None:
        return np.zeros((1, 0), dtype=dtype)
    return np.ascontiguousarray(np.asarray(arr, dtype=dtype).reshape(1, -1))


def request_arrays(op: str, fence: Fence, **optional: Any) -> dict[str, np.ndarray]:
    """Inverse of parse_request for clients and the pipeline (batch dim 1 included)."""
    arrays: dict[str, np.ndarray] = {
        "OP": np.array([[op.encode()]], dtype=np.object_),
        "FENCE": np.array([fence], dtype=np.int64),
    }
    if (nf := optional.get("next_fence")) is not None:
        arrays["NEXT_FENCE"] = np.array([nf], dtype=np.int64)
    if (cfg := optional.get("config")) is not None:
        arrays["CONFIG"] = np.array([[json.dumps(cfg).encode()]], dtype=np.object_)
    if (pcm := optional.get("pcm")) is not None:
        arrays["PCM"] = np.asarray(pcm, dtype=np.float32).reshape(1, -1)
    if frames := optional.get("frames"):
        arrays["FRAMES"] = np.array([list(frames)], dtype=np.object_)
    if (fl := optional.get("force_listen")) is not None:
        arrays["FORCE_LISTEN"] = np.array([[bool(fl)]], dtype=np.bool_)
    if (tok := optional.get("tokens")) is not None:
        arrays["TOKENS"] = np.asarray(tok, dtype=np.int64).reshape(1, -1)
    if (hid := optional.get("hidden")) is not None:
        arrays["HIDDEN"] = np.asarray(hid, dtype=np.float32).reshape(1, -1)
    return arrays


def coalesce(outs: list[StageOutput]) -> StageOutput:
    """Many outputs as one: EVENT {"type": "batch", "events": [...], "sizes": [[audio, tokens, hidden], ...]}
    and each payload concatenated in order (`split` inverts it)."""
    sizes = [[_size(o.audio), _size(o.tokens), _size(o.hidden)] for o in outs]
    return StageOutput({"type": BATCH_EVENT, "events": [o.event for o in outs], "sizes": sizes},
                       audio=_cat([o.audio for o in outs], np.int16), tokens=_cat([o.tokens for o in outs], np.int64),
                       hidden=_cat([o.hidden for o in outs], np.float32))


def split(out: StageOutput) -> list[StageOutput]:
    """A `batch` output back into its outputs; any other output is returned alone."""
    if out.event.get("type") != BATCH_EVENT:
        return [out]
    payloads = [np.zeros(0, dt) if a is None else np.asarray(a).reshape(-1)
                for a, dt in ((out.audio, np.int16), (out.tokens, np.int64), (out.hidden, np.float32))]
    at, result = [0, 0, 0], []
    for event, sizes in zip(out.event["events"], out.event["sizes"], strict=True):
        parts = []
        for k, n in enumerate(sizes):   # as on the wire: an absent payload is an empty array
            parts.append(payloads[k][at[k]: at[k] + n])
            at[k] += n
        result.append(StageOutput(event, audio=parts[0], tokens=parts[1], hidden=parts[2]))
    return result


def _size(arr: np.ndarray | None) -> int:
    return 0 if arr is None else int(np.asarray(arr).size)


def _cat(arrs: list[np.ndarray | None], dtype: type) -> np.ndarray | None:
    parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrs if a is not None and np.asarray(a).size]
    return np.concatenate(parts) if parts else None


def decode_event(arr: np.ndarray) -> dict[str, Any]:
    return json.loads(_text(arr))
