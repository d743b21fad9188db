"""CPU cost per journaled event of the write-through to Redis (gateway/directory/replica.py), on a real redis-server.

    .venv/bin/python -m tests.scaleout.bench_replica [--events 4000] [--event-bytes 600] [--burst 4]

Feeds one session's journal the way the writer does (`Journal.offer`, an ack every 32 events), `--burst` events
every 10 ms (a speaking session sends a few events per unit), once without and once with the replicator, and
reports this process's CPU time per event (time.process_time: the hot path, the state capture, the pipeline) and
the pipelines written. The session carries a conversation of 40 items so the state is not trivially small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from gateway.directory.replica import Replicator
from gateway.directory.store import SessionDirectory
from gateway.protocol.config import response_defaults
from gateway.resume.journal import Journal, JournalConfig
from tests.scaleout.cluster import Cluster
from tests.scaleout.test_replica_store import Host, new_session

ACK_EVERY = 32
TICK_S = 0.01


def _session_with_history() -> Host:
    session = new_session()
    for _ in range(40):
        resp = session.responses.open_response("model", response_defaults(session.config), precreated=False,
                                               input_item_id=None)
        session.responses.finish(resp, "completed", "turn_end")
    return Host(session, journal=Journal(JournalConfig(60.0, 8 << 20)))


async def _feed(host: Host, events: int, event_bytes: int, burst: int) -> float:
    pad = "x" * max(0, event_bytes - 60)
    t0 = time.process_time()
    for seq in range(1, events + 1):
        host.journal.offer(seq, json.dumps({"type": "response.output_audio.delta", "server_event_seq": seq,
                                            "delta": pad}).encode())
        if seq % ACK_EVERY == 0:
            host.journal.ack(seq - ACK_EVERY // 2)
        if seq % burst == 0:
            await asyncio.sleep(TICK_S)
    await asyncio.sleep(0.2)  # the last write
    return time.process_time() - t0


async def _tight(directory: SessionDirectory, host: Host, events: int, event_bytes: int) -> float:
    """CPU per event when every event is written on its own, back to back: offer, note, capture, write."""
    rep = Replicator(directory, "sess_1", host)
    data = json.dumps({"type": "x", "delta": "x" * max(0, event_bytes - 30)}).encode()
    t0 = time.process_time()
    for seq in range(1, events + 1):
        host.journal.offer(seq, data)
        rep.appended(seq, data)
        await rep.flush()
    return (time.process_time() - t0) / events * 1e6


async def main(events: int, event_bytes: int, burst: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            url = cluster.start_redis().url
            bare = await _feed(_session_with_history(), events, event_bytes, burst)
            directory = SessionDirectory(url, "bench:1", 10.0)
            await directory.register("sess_1", "t:8001", 1, 1)
            host = _session_with_history()
            rep = Replicator(directory, "sess_1", host)
            rep.start()
            replicated = await _feed(host, events, event_bytes, burst)
            await rep.aclose()
            tight = await _tight(directory, _session_with_history(), min(events, 1000), event_bytes)
            await directory.aclose()
        finally:
            cluster.stop()
    per = (replicated - bare) / events * 1e6
    print(f"events={events} event_bytes={event_bytes} burst={burst}/{TICK_S * 1000:.0f}ms: "
          f"CPU without write-through {bare / events * 1e6:.1f} us/event, with {replicated / events * 1e6:.1f} "
          f"us/event: +{per:.1f} us/event; {rep.writes} writes ({events / max(rep.writes, 1):.1f} events each); "
          f"one event per write back to back (no sleeps, warm caches): {tight:.1f} us/event")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=4000)
    p.add_argument("--event-bytes", type=int, default=600)
    p.add_argument("--burst", type=int, default=4)
    a = p.parse_args()
    asyncio.run(main(a.events, a.event_bytes, a.burst))
