"""`TritonRuntime`: the `Runtime` protocol over `tritonclient.grpc.aio` bidirectional streaming.

One gRPC stream per session (its Triton sequence). A reader task demultiplexes responses by request id:
model events go to the session's event queue tagged with the fence epoch of the request that produced
them; the final response of a request (`triton_final_response`) resolves that operation's future, or an
`error` EVENT fails it with the runtime code.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.runtime.base import (
    RUNTIME_DEAD,
    Fence,
    Readiness,
    RuntimeEvent,
    RuntimeFailure,
    SessionKey,
    UnitSubmission,
)
from gateway.runtime.grpc_client import probe_readiness
from gateway.runtime.triton_wire import as_unit, build_request, parse_event


class _SequenceStream:
    """The request queue, pending operations and event queue of one Triton sequence."""

    def __init__(self, client: Any, model: str, key: SessionKey, batch_dim: bool) -> None:
        self.client, self.model, self.key, self.batch_dim = client, model, key, batch_dim
        self.requests: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.events: asyncio.Queue[RuntimeEvent | None] = asyncio.Queue()
        self.pending: dict[str, tuple[asyncio.Future[None], int, int | None]] = {}  # rid -> (waiter, epoch, unit)
        self._ids = itertools.count(1)
        self.broken: RuntimeFailure | None = None  # set once the stream is gone: later calls fail at once
        self.reader = asyncio.create_task(self._read(), name=f"triton:{key.session_id}")

    async def _iter(self) -> AsyncIterator[dict[str, Any]]:
        while (req := await self.requests.get()) is not None:
            yield req

    async def call(self, op: str, fence: Fence, **kw: Any) -> None:
        if self.broken is not None:
            raise self.broken  # nobody reads a dead stream: waiting would only time out
        rid = f"{op}-{next(self._ids)}"
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        unit = kw.get("unit")
        self.pending[rid] = (fut, fence.epoch, None if unit is None else unit.unit_index)
        self.requests.put_nowait(build_request(self.model, self.key.correlation_id, rid, op, fence,
                                               batch_dim=self.batch_dim, **kw))
        try:
            await fut
        finally:
            self.pending.pop(rid, None)

    async def _read(self) -> None:
        try:
            async for result, error in self.client.stream_infer(self._iter()):
                if error is not None:
                    self._fail_all(RuntimeFailure("internal_error", str(error)))
                    continue
                self._on_result(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream is gone: every waiter and the session learn it
            self.broken = RuntimeFailure(RUNTIME_DEAD, f"stream broke: {exc}")
            self._fail_all(self.broken)
        finally:
            if self.broken is None:
                self.broken = RuntimeFailure(RUNTIME_DEAD, "stream ended")
                self._fail_all(self.broken)
            self.events.put_nowait(None)

    def _on_result(self, result: Any) -> None:
        resp = result.get_response()
        rid = resp.id
        fut, epoch, unit = self.pending.get(rid, (None, 0, None))
        raw = result.as_numpy("EVENT")
        if raw is not None and raw.size:
            audio = result.as_numpy("AUDIO")
            ev = parse_event(raw.reshape(-1)[0], audio, epoch)
            if isinstance(ev, dict):
                if ev.get("type") == "error" and fut is not None and not fut.done():
                    fut.set_exception(RuntimeFailure(ev.get("code", "internal_error"), ev.get("message", "")))
            else:
                self.events.put_nowait(ev if unit is None else as_unit(ev, unit))
        final = resp.parameters.get("triton_final_response")
        if final is not None and final.bool_param and fut is not None and not fut.done():
            fut.set_result(None)

    def _fail_all(self, exc: RuntimeFailure) -> None:
        for fut, _, _ in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(exc)

    async def aclose(self) -> None:
        self.requests.put_nowait(None)
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reader


class TritonRuntime:
    def __init__(self, url: str, model: str, ready_models: tuple[str, ...], *, batch_dim: bool = True,
                 client: Any = None) -> None:
        self._url, self._model, self._ready_models, self._batch_dim = url, model, ready_models, batch_dim
        self._client = client
        self._streams: dict[int, _SequenceStream] = {}

    def _get_client(self) -> Any:
        if self._client is None:
            from gateway.runtime.grpc_client import triton_client  # noqa: PLC0415 - created on the loop

            self._client = triton_client(self._url)
        return self._client

    def _stream(self, key: SessionKey) -> _SequenceStream:
        s = self._streams.get(key.correlation_id)
        if s is None:
            raise RuntimeFailure("session_not_found", "no open sequence for this session")
        return s

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        stream = _SequenceStream(self._get_client(), self._model, key, self._batch_dim)
        self._streams[key.correlation_id] = stream
        try:
            await stream.call("open", fence, config=config)
        except BaseException:
            self._streams.pop(key.correlation_id, None)
            await stream.aclose()
            raise

    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        await self._stream(key).call("append", fence, unit=unit)

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        await self._stream(key).call("cancel", fence, next_fence=next_fence)

    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        await self._stream(key).call("update", fence, config=config)

    async def close(self, key: SessionKey, fence: Fence) -> None:
        stream = self._stream(key)
        try:
            if stream.broken is None:  # a dead stream's sequence holds nothing: Triton's idle timeout ends it
                await stream.call("close", fence)
        except RuntimeFailure as exc:
            # already gone (a stage expired it, or the stream broke meanwhile): closed all the same
            if exc.code not in ("session_not_found", RUNTIME_DEAD):
                raise
        finally:
            self._streams.pop(key.correlation_id, None)
            await stream.aclose()

    async def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        stream = self._stream(key)
        while (ev := await stream.events.get()) is not None:
            yield ev

    async def readiness(self) -> Readiness:
        return await probe_readiness(self._get_client(), self._ready_models)

    async def aclose(self) -> None:
        for s in list(self._streams.values()):
            await s.aclose()
        self._streams.clear()
        if self._client is not None:
            await self._client.close()
