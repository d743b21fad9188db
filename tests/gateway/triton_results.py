"""Stand-ins for tritonclient's streamed `InferResult`, for the runtime tests that fake the gRPC client."""

from __future__ import annotations

import json

import numpy as np


class _Param:
    def __init__(self, b: bool) -> None:
        self.bool_param = b


class _Resp:
    def __init__(self, rid: str, final: bool) -> None:
        self.id = rid
        self.parameters = {"triton_final_response": _Param(final)}


class Result:
    """One streamed response: its request id, an optional EVENT and output arrays by name (AUDIO, TOKENS, ...)."""

    def __init__(self, rid: str, event: dict | None, final: bool = False, **arrays: np.ndarray) -> None:
        self._resp, self._event, self._arrays = _Resp(rid, final), event, arrays

    def get_response(self) -> _Resp:
        return self._resp

    def as_numpy(self, name: str) -> np.ndarray | None:
        if name == "EVENT":
            return None if self._event is None else np.array([[json.dumps(self._event).encode()]], dtype=np.object_)
        return self._arrays.get(name)
