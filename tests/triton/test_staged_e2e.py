"""The served path through the real tritonserver: the gateway's `StagedTritonRuntime` over the real stage engines.

Tiny checkpoint on CPU, stage0 on a scripted decision plan (tests/e2e/profiles/scripted.yaml) so that sessions
speak on a known cycle. A spy around the real gRPC client records when each request went out and when each of
its responses came back, so the tests read the overlap and the streaming from what crossed the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.loadgen.stages import means, scrape
from gateway.runtime.base import AudioPiece, Decision, Fence, SessionKey, UnitDone, UnitSubmission
from gateway.runtime.stages import STAGES, StagedTritonRuntime
from serve.launcher import TritonInstall, TritonServer
from tests.e2e.stack import stop_soon

from .conftest import REPO_ROOT, DeployProfile, build_repository, start_server

pytestmark = pytest.mark.e2e
SESSIONS = 8
FIRST_UNIT, UNIT = 16_480, 16_000
# scripted.yaml: 3 forced listen units, then cycles of 1 listen + 2 speak units
SPEAK_UNITS = (4, 5)
UNITS_PER_SESSION = 6
ACK_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(triton_install: TritonInstall, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
           background_stops: None) -> Iterator[TritonServer]:
    profile = DeployProfile.load(REPO_ROOT / "tests" / "e2e" / "profiles" / "scripted.yaml", max_sessions=SESSIONS)
    repo = build_repository(str(tiny_checkpoint), profile, tmp_path_factory.mktemp("staged") / "models",
                            models=STAGES)
    srv = start_server(triton_install, repo, tmp_path_factory.mktemp("staged-log") / "triton.log", models=STAGES)
    try:
        yield srv
    finally:
        stop_soon(srv.stop, "staged-server")  # graceful, while the next tests run


class Spy:
    """Wraps a tritonclient aio client: (time, request id, what) for every request sent and response received."""

    def __init__(self, client: Any) -> None:
        self.client, self.log = client, []

    async def stream_infer(self, requests: AsyncIterator[dict[str, Any]]) -> AsyncIterator[Any]:
        async def sent() -> AsyncIterator[dict[str, Any]]:
            async for req in requests:
                self.log.append((time.monotonic(), req["request_id"], "sent"))
                yield req

        async for result, error in self.client.stream_infer(sent()):
            if result is not None:
                resp = result.get_response()
                final = resp.parameters.get("triton_final_response")
                raw = result.as_numpy("EVENT")
                kind = json.loads(raw.reshape(-1)[0])["type"] if raw is not None and raw.size else None
                self.log.append((time.monotonic(), resp.id, "final" if final and final.bool_param else kind))
            yield result, error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def span(self, rid: str) -> tuple[float, float]:
        times = [t for t, r, what in self.log if r == rid and what in ("sent", "final")]
        return times[0], times[-1]

    def rids(self, corr_prefix: str) -> list[str]:
        return list(dict.fromkeys(r for _, r, _ in self.log if r.startswith(corr_prefix)))


def _pcm(index: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed * 100 + index)
    return (rng.standard_normal(FIRST_UNIT if index == 0 else UNIT) * 0.1).astype(np.float32).tobytes()


async def _session(rt: StagedTritonRuntime, key: SessionKey, units: int, seen: list[Any],
                   config: dict[str, Any] | None = None, pcm: Callable[[int], bytes] | None = None) -> None:
    """Open `key` (`config`, default: seeded by its correlation id), append `units` units (`pcm(i)`, default:
    `_pcm`), collect every event into `seen` until the last unit is done (or the ack timeout), close."""
    await rt.open(key, Fence(1, 0), config or {"seed": key.correlation_id})
    pcm = pcm or (lambda i: _pcm(i, key.correlation_id))
    all_done = asyncio.Event()

    async def collect() -> None:
        async for ev in rt.events(key):
            seen.append(ev)
            if sum(isinstance(e, UnitDone) for e in seen) == units:
                all_done.set()

    collector = asyncio.create_task(collect())
    for i in range(units):
        await asyncio.wait_for(rt.append(key, Fence(1, 0, i + 1), UnitSubmission(i, pcm(i))),
                               ACK_TIMEOUT_S)
    with contextlib.suppress(TimeoutError):  # the last speak unit's audio follows its ack; asserted by the caller
        await asyncio.wait_for(all_done.wait(), ACK_TIMEOUT_S)
    await rt.close(key, Fence(1, 0))
    collector.cancel()


def _runtime(server: TritonServer) -> tuple[StagedTritonRuntime, Spy]:
    from tritonclient.grpc.aio import InferenceServerClient  # noqa: PLC0415 - created on the loop

    spy = Spy(InferenceServerClient(server.grpc_url))
    return StagedTritonRuntime(server.grpc_url, client=spy), spy


async def test_eight_sessions_batch_in_every_stage_and_tts_overlaps_the_next_stage0_unit(server: TritonServer
                                                                                          ) -> None:
    metrics_url = f"http://127.0.0.1:{server.ports.metrics}/metrics"
    before = scrape(metrics_url)
    rt, spy = _runtime(server)
    seen: dict[int, list[Any]] = {k: [] for k in range(1, SESSIONS + 1)}
    await asyncio.gather(*(_session(rt, SessionKey(f"s{k}", k), UNITS_PER_SESSION, seen[k]) for k in seen))
    await asyncio.sleep(1.0)  # the stage metrics are flushed to Triton every 0.5 s
    rows = means(before, scrape(metrics_url))["rows_per_step"]
    await rt.aclose()

    for k, events in seen.items():
        done = [e.unit for e in events if isinstance(e, UnitDone)]
        assert done == list(range(UNITS_PER_SESSION)), f"session {k}: units done {done}"
        speaking = {e.unit for e in events if isinstance(e, Decision) and e.action == "speak"}
        assert speaking == set(SPEAK_UNITS)
        audio_units = {e.unit for e in events if isinstance(e, AudioPiece)}
        assert audio_units == set(SPEAK_UNITS)
        last_audio = max(i for i, e in enumerate(events) if isinstance(e, AudioPiece) and e.unit == 4)
        assert events.index(next(e for e in events if isinstance(e, UnitDone) and e.unit == 4)) > last_audio
    # every stage's steps served several sessions at once
    assert all(rows[s] is not None and rows[s] > 1.0 for s in STAGES), rows
    # TTS of a speak unit ran while stage0 worked on the session's next unit: the gateway did not wait
    tts = [r for r in spy.rids("tts:append")]
    stage0 = [r for r in spy.rids("stage0:append")]
    overlaps = 0
    for t in tts:
        t0, t1 = spy.span(t)
        overlaps += any(spy.span(s)[0] < t1 and spy.span(s)[1] > t0 for s in stage0)
    assert overlaps > 0
    # decisions and text left stage0 before the unit's end (one response per event, not one per unit)
    for rid in stage0:
        kinds = [what for _, r, what in spy.log if r == rid and what != "sent"]
        assert kinds[-1] == "final" and len(kinds) > 2, kinds


async def test_a_cancel_mid_unit_stops_audio_within_one_token2wav_call(server: TritonServer) -> None:
    rt, spy = _runtime(server)
    key = SessionKey("c", 99)
    await rt.open(key, Fence(1, 0), {"seed": 3})
    seen: list[Any] = []

    async def collect() -> None:
        async for ev in rt.events(key):
            seen.append(ev)

    collector = asyncio.create_task(collect())
    for i in range(SPEAK_UNITS[0] + 1):  # up to and including the first speak unit
        await asyncio.wait_for(rt.append(key, Fence(1, 0, i + 1), UnitSubmission(i, _pcm(i, 3))), ACK_TIMEOUT_S)
    cancel_at = time.monotonic()  # stage0 is done with the speak unit; TTS / Token2Wav are on it now
    await asyncio.wait_for(rt.cancel(key, Fence(1, 0, 5), Fence(1, 1, 5)), ACK_TIMEOUT_S)
    await asyncio.sleep(1.0)
    late_calls = {r for t, r, what in spy.log if t > cancel_at and r.startswith("token2wav:append") and what == "audio"}
    sent_late = [r for t, r, what in spy.log if t > cancel_at and r.startswith("token2wav:append") and what == "sent"]
    assert len(late_calls) <= 1 and not sent_late, (late_calls, sent_late)
    assert not [e for e in seen if e.epoch == 0 and getattr(e, "kind", "") == "audio" and e.unit > SPEAK_UNITS[0]]
    # the session goes on under the new epoch
    await asyncio.wait_for(rt.append(key, Fence(1, 1, 6), UnitSubmission(5, _pcm(5, 3))), ACK_TIMEOUT_S)
    await asyncio.sleep(0.5)
    assert any(isinstance(e, UnitDone) and e.epoch == 1 for e in seen)
    await rt.close(key, Fence(1, 1))
    collector.cancel()
    await rt.aclose()
