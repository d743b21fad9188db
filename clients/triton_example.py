"""Talk to the `duplex` pipeline (or one stage) directly over Triton gRPC streaming.

    python clients/triton_example.py --url 127.0.0.1:8002 --wav speech.wav

Opens one session (a Triton sequence keyed by a random 63-bit CORRELATION_ID), streams the WAV as
1 s units (the first 1030 ms), prints every event as it arrives, writes the reply audio to
reply.wav, then closes. `TritonSession` is small enough to copy into another client; the contract is
docs/triton.md. Imports neither torch nor the project's engine.
"""

from __future__ import annotations

import argparse
import json
import queue
import secrets
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

INPUT_RATE = 16_000
OUTPUT_RATE = 24_000
FIRST_UNIT_SAMPLES = 16_480
UNIT_SAMPLES = 16_000
OUTPUTS = ("EVENT", "AUDIO")
CORRID_BITS = 63


class TritonUnavailable(RuntimeError):
    """The stream broke (server stopped or restarted): the session's state on Triton is gone."""


@dataclass
class Reply:
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]


class TritonSession:
    """One session = one gRPC stream + one Triton sequence. Requests are sent and answered in order."""

    def __init__(self, url: str, model: str = "duplex", corrid: int | None = None) -> None:
        self.model, self.corrid = model, corrid or secrets.randbits(CORRID_BITS) or 1
        self._client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        self._n = 0

    def request(self, op: str, fence: tuple[int, int, int], timeout_s: float = 30.0, **payload: Any) -> Reply:
        """Send one request and gather its responses up to the FINAL flag."""
        self._n += 1
        req_id = f"{self.corrid}-{self._n}"
        try:
            self._client.async_stream_infer(
                self.model, _inputs(op, fence, **payload), outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
                request_id=req_id, sequence_id=self.corrid, sequence_start=op == "open", sequence_end=op == "close",
                enable_empty_final_response=True,
            )
        except InferenceServerException as exc:  # the stream broke before this request
            raise _classify(exc) from exc
        reply = Reply()
        while True:
            try:
                result, error = self._responses.get(timeout=timeout_s)
            except queue.Empty as exc:
                raise TritonUnavailable(f"no response to {op} within {timeout_s}s") from exc
            if error is not None:
                raise _classify(error)
            resp = result.get_response()
            if resp.outputs:
                reply.events.append(json.loads(result.as_numpy("EVENT").reshape(-1)[0]))
                audio = result.as_numpy("AUDIO").reshape(-1)
                if audio.size:
                    reply.audio.append(audio)
            if resp.parameters["triton_final_response"].bool_param:
                return reply

    def close(self) -> None:
        self._client.stop_stream(cancel_requests=True)
        self._client.close()


def _classify(error: InferenceServerException) -> Exception:
    msg = str(error)
    if "START flag" in msg:  # Triton's sequence batcher: this CORRELATION_ID has no open sequence
        return KeyError(f"session_not_found: {msg}")
    broken = ("Socket closed", "UNAVAILABLE", "unavailable", "Connection reset", "failed to connect",
              "no longer in valid state")
    if any(k in msg for k in broken):
        return TritonUnavailable(f"triton_unavailable: {msg}")
    return RuntimeError(msg)


def _inputs(op: str, fence: tuple[int, int, int], **payload: Any) -> list[grpcclient.InferInput]:
    arrays: dict[str, np.ndarray] = {"OP": np.array([[op.encode()]], dtype=np.object_),
                                     "FENCE": np.array([fence], dtype=np.int64)}
    if (nf := payload.get("next_fence")) is not None:
        arrays["NEXT_FENCE"] = np.array([nf], dtype=np.int64)
    if (cfg := payload.get("config")) is not None:
        arrays["CONFIG"] = np.array([[json.dumps(cfg).encode()]], dtype=np.object_)
    if (pcm := payload.get("pcm")) is not None:
        arrays["PCM"] = np.asarray(pcm, dtype=np.float32).reshape(1, -1)
    if (fl := payload.get("force_listen")) is not None:
        arrays["FORCE_LISTEN"] = np.array([[bool(fl)]], dtype=np.bool_)
    dtypes = {np.dtype(np.object_): "BYTES", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
              np.dtype(np.bool_): "BOOL"}
    inputs = []
    for name, arr in arrays.items():
        tensor = grpcclient.InferInput(name, list(arr.shape), dtypes[arr.dtype])
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs


def units_of(pcm: np.ndarray) -> list[np.ndarray]:
    """Cut 16 kHz float PCM into model units (1030 ms, then 1 s), zero-padding the last one."""
    units, pos, size = [], 0, FIRST_UNIT_SAMPLES
    while pos < pcm.size:
        unit = np.zeros(size, dtype=np.float32)
        chunk = pcm[pos:pos + size]
        unit[:chunk.size] = chunk
        units.append(unit)
        pos, size = pos + size, UNIT_SAMPLES
    return units


def read_wav_16k(path: str) -> np.ndarray:
    with wave.open(path, "rb") as wav:
        if wav.getframerate() != INPUT_RATE or wav.getnchannels() != 1 or wav.getsampwidth() != 2:
            raise SystemExit(f"{path}: need 16 kHz mono PCM16 (sox in.wav -r 16000 -c 1 -b 16 out.wav)")
        return np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8002", help="Triton gRPC address")
    ap.add_argument("--wav", required=True, help="16 kHz mono PCM16 WAV")
    ap.add_argument("--out", default="reply.wav")
    args = ap.parse_args()
    session, epoch = TritonSession(args.url), (1, 1)
    try:
        print(session.request("open", (*epoch, 0), config={"voice": "default"}).events)
        reply_audio = []
        for seq, unit in enumerate(units_of(read_wav_16k(args.wav)), start=1):
            reply = session.request("append", (*epoch, seq), pcm=unit)
            for event in reply.events:
                print(event)
            reply_audio += reply.audio
        print(session.request("close", (*epoch, 0)).events)
    finally:
        session.close()
    with wave.open(args.out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(OUTPUT_RATE)
        wav.writeframes(np.concatenate(reply_audio).tobytes() if reply_audio else b"")
    print(f"reply audio: {args.out}")


if __name__ == "__main__":
    main()
