"""Test helpers: a spoken WAV (espeak-ng, resampled with soxr) and a gateway-style session run.

A session run is what the gateway does: one gRPC stream per session, open, each unit awaited in order,
close. With random tiny weights the decisions are random, so sessions open with `force_listen_count`
0 and a fixed seed, and tests assert on structure (event order, units, PCM), not on tokens.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import soxr
import tritonclient.grpc as grpcclient

from clients.triton_example import INPUT_RATE, OUTPUTS, Reply, TritonSession, units_of
from model_repository.common.codec import request_arrays

SPOKEN_TEXT = "hello, can you hear me? tell me a story about the sea"


def spoken_pcm(folder: Path) -> np.ndarray:
    """espeak-ng speech as 16 kHz float32 mono."""
    if not shutil.which("espeak-ng"):
        raise RuntimeError("espeak-ng is required (make install puts it in)")
    raw = folder / "spoken.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), SPOKEN_TEXT], check=True, capture_output=True)
    audio, rate = soundfile.read(str(raw), dtype="float32", always_2d=True)
    return soxr.resample(audio[:, 0], rate, INPUT_RATE).astype(np.float32)


def session_config(seed: int, **extra: Any) -> dict[str, Any]:
    return {"voice": "default", "seed": seed, "force_listen_count": 0, **extra}


@dataclass
class Run:
    opened: Reply
    units: list[Reply]
    closed: Reply

    def decisions(self) -> list[str]:
        return [r.of_type("decision")[0]["action"] for r in self.units]

    def tokens(self) -> list[list[int]]:
        return [[e["token_id"] for e in r.of_type("text")] for r in self.units]

    def pcm(self) -> np.ndarray:
        chunks = [a for r in self.units for a in r.audio]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


def run_session(url: str, pcm: np.ndarray, seed: int, model: str = "duplex", timeout_s: float = 60.0,
                **config: Any) -> Run:
    session = TritonSession(url, model=model)
    try:
        opened = session.request("open", (1, 1, 0), config=session_config(seed, **config))
        units = [session.request("append", (1, 1, i + 1), pcm=u, timeout_s=timeout_s)
                 for i, u in enumerate(units_of(pcm))]
        return Run(opened, units, session.request("close", (1, 1, 0)))
    finally:
        session.close()


_WIRE_TYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
               np.dtype(np.bool_): "BOOL"}


@dataclass
class StageReply(Reply):
    responses: list[tuple[bool, bool]] = field(default_factory=list)  # per response: (carries outputs, FINAL)


class StageSession(TritonSession):
    """A TritonSession that also sends the stage payload inputs (TOKENS, HIDDEN) for tts/token2wav."""

    def request(self, op: str, fence: tuple[int, int, int], timeout_s: float = 30.0, **payload: Any) -> StageReply:
        self._n += 1
        self._client.async_stream_infer(
            self.model, _stage_inputs(op, fence, **payload), outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
            request_id=f"{self.corrid}-{self._n}", sequence_id=self.corrid, sequence_start=op == "open",
            sequence_end=op == "close", enable_empty_final_response=True)
        reply = StageReply()
        while True:
            result, error = self._responses.get(timeout=timeout_s)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:
                reply.events.append(json.loads(result.as_numpy("EVENT").reshape(-1)[0]))
            final = resp.parameters["triton_final_response"].bool_param
            reply.responses.append((bool(resp.outputs), final))
            if final:
                return reply


def pipelined(session: TritonSession, requests: list[tuple[str, tuple[int, int, int], dict[str, Any]]],
              timeout_s: float = 60.0) -> list[Reply]:
    """Send every request at once on the session's stream, then gather each one's reply up to its FINAL."""
    ids = []
    for op, fence, payload in requests:
        session._n += 1
        ids.append(f"{session.corrid}-{session._n}")
        session._client.async_stream_infer(
            session.model, _stage_inputs(op, fence, **payload),
            outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS], request_id=ids[-1],
            sequence_id=session.corrid, sequence_start=op == "open", sequence_end=op == "close",
            enable_empty_final_response=True)
    replies = {i: Reply() for i in ids}
    open_ids = list(ids)
    while open_ids:
        result, error = session._responses.get(timeout=timeout_s)
        assert error is None, error
        resp = result.get_response()
        assert resp.id == open_ids[0], f"reply of {resp.id} while {open_ids[0]} is not final"  # in order
        if resp.outputs:
            replies[resp.id].events.append(json.loads(result.as_numpy("EVENT").reshape(-1)[0]))
        if resp.parameters["triton_final_response"].bool_param:
            open_ids.pop(0)
    return [replies[i] for i in ids]


def _stage_inputs(op: str, fence: tuple[int, int, int], **payload: Any) -> list[grpcclient.InferInput]:
    inputs = []
    for name, arr in request_arrays(op, fence, **payload).items():
        tensor = grpcclient.InferInput(name, list(arr.shape), _WIRE_TYPES[arr.dtype])
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs
