"""Conformance checker for recorded server event streams (protocol.md §1.4, §3.4-§3.9, Appendix B).

Works on what a client received: a list of decoded JSON events from one connection, in order. It needs no
access to the gateway, so the same checker runs over streams recorded from the fake runtime now and from
the real Triton stack later. `check(events, profile)` returns the list of violations (empty = conformant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.profiles import BETA_NAMES

Json = dict[str, Any]
_FROM_BETA = {v: k for k, v in BETA_NAMES.items()}
UNSEQUENCED = {"session.created", "session.resumed", "session.replaced", "session.resync_required",
               "session.heartbeat_ack"}
STREAMING = {"response.speak", "response.output_audio.delta", "response.output_audio_transcript.delta",
             "response.output_text.delta"}
CLIENT_CANCEL_REASONS = {"client_cancelled", "barge_in", "output_cleared", "input_cancelled", "truncated",
                         "session_close"}


@dataclass
class _Resp:
    rid: str
    created_at: int
    epoch: int
    phase: int = 1  # last R-step reached
    opening: list[str] = field(default_factory=list)
    spoke: int = 0
    audio_deltas: int = 0
    transcript: str = ""
    text_only: bool = False
    closing: list[str] = field(default_factory=list)
    done_at: int | None = None
    status: str | None = None
    listened: bool = False
    audio_ms: int = 0
    unit_chars: list[tuple[int, int]] = field(default_factory=list)  # (model_unit_index, chars) of each text delta

    def chars_through(self, unit: int) -> int:
        """§7.5: the transcript an audio delta of `unit` covers (later units' early text excluded)."""
        return sum(n for u, n in self.unit_chars if u <= unit)


def _canonical(ev: Json, profile: str) -> Json:
    if profile != "beta":
        return ev
    ev = dict(ev, type=_FROM_BETA.get(ev["type"], ev["type"]))
    return ev


def check(events: list[Json], profile: str = "ga") -> list[str]:  # noqa: C901 - one pass over the rules
    errs: list[str] = []
    evs = [_canonical(e, profile) for e in events]
    seen_ids: set[str] = set()
    next_seq = 1
    resps: dict[str, _Resp] = {}
    active: _Resp | None = None
    last_done: _Resp | None = None
    dead_epoch = -1  # highest epoch of a cancelled response (no delta of epoch <= it may follow its done)
    commits: dict[str, list[str]] = {}
    closed_at: int | None = None
    listen_units: set[int] = set()

    def bad(i: int, msg: str) -> None:
        errs.append(f"#{i} {evs[i]['type']}: {msg}")

    for i, ev in enumerate(evs):
        t = ev["type"]
        # ---- envelope (§1.4) ----
        eid = ev.get("event_id")
        if not isinstance(eid, str) or not eid or len(eid) > 64 or eid in seen_ids:
            bad(i, f"event_id missing, too long or reused: {eid!r}")
        seen_ids.add(eid)
        seq = ev.get("server_event_seq")
        if t in UNSEQUENCED and seq is not None:
            bad(i, "unsequenced event carries server_event_seq")
        if t not in UNSEQUENCED and t != "error" and seq is None:
            bad(i, "sequenced event lacks server_event_seq")
        if seq is not None:
            if seq != next_seq:
                bad(i, f"server_event_seq {seq} != expected {next_seq}")
            next_seq = seq + 1
        if i == 0 and t not in ("session.created", "session.resumed", "error"):
            bad(i, "first event must be session.created / session.resumed (or a handshake error)")
        if closed_at is not None:
            bad(i, "event after session.closed / session.expired")
        if t in ("session.closed", "session.expired"):
            closed_at = i
        if t == "resume_token" or ("resume_token" in ev and seq is not None):
            bad(i, "resume token in a sequenced event")
        # ---- C-6: nothing between R7 and R8 ----
        if last_done is not None and last_done.phase == 7 and t != "rate_limits.updated":
            bad(i, f"event between response.done and rate_limits.updated of {last_done.rid}")
        # ---- C-3: an audio delta is immediately followed by its transcript delta ----
        if i > 0 and evs[i - 1]["type"] == "response.output_audio.delta":
            prev = evs[i - 1]
            if t != "response.output_audio_transcript.delta" or ev.get("response_id") != prev.get("response_id"):
                bad(i, "audio delta not immediately followed by its transcript delta (C-3)")
        if t == "response.output_audio_transcript.delta" and not ev.get("delta") and (
                i == 0 or evs[i - 1]["type"] != "response.output_audio.delta"):
            bad(i, "empty transcript delta without the audio delta right before it (only a pair's half is empty)")
        # ---- response lifecycle (§3.4) ----
        if t == "response.created":
            r = ev["response"]
            rid = r["id"]
            if rid in resps:
                bad(i, f"response id {rid} reused (C-7)")
            if active is not None:
                bad(i, f"response {rid} created while {active.rid} is non-terminal (C-1)")
            if last_done is not None and last_done.phase < 8:
                bad(i, "response created before the previous response's rate_limits.updated (C-1)")
            active = resps[rid] = _Resp(rid, i, r.get("duplex", {}).get("epoch", 0),
                                        text_only=r.get("output_modalities") == ["text"])
            continue
        rid = _response_of(ev)
        resp = resps.get(rid) if isinstance(rid, str) else None
        opening = ("conversation.item.added", "response.output_item.added", "response.content_part.added")
        if t in opening and resp is not None:
            if resp.phase != 1 or len(resp.opening) != opening.index(t):
                bad(i, f"R2 out of order for {resp.rid}")
            resp.opening.append(t)
            if len(resp.opening) == 3:
                resp.phase = 2
            continue
        if t in STREAMING:
            if resp is None:
                bad(i, "streaming event for an unknown response")
                continue
            if resp.done_at is not None:
                bad(i, f"streaming event after response.done of {resp.rid} (S-1)")
            if resp.phase < 2:
                bad(i, "output before R2 completed")
            md = ev.get("metadata") or {}
            ep = ev.get("epoch", md.get("epoch"))
            if ep is not None and ep <= dead_epoch:
                bad(i, f"delta of dead epoch {ep} after its cancellation (K0)")
            if t == "response.speak":
                resp.spoke += 1
                if resp.spoke > 1:
                    bad(i, "response.speak more than once (R3)")
                if resp.audio_deltas or resp.transcript:
                    bad(i, "response.speak after a delta (R3)")
            elif t == "response.output_audio.delta":
                resp.audio_deltas += 1
                if resp.text_only:
                    bad(i, "audio delta in a text-only response")
                if resp.audio_deltas == 1 and not ev.get("delta"):
                    bad(i, "the response's first audio delta carries no audio (a silent speak unit is 1 s of "
                           "zeros, model.md §6.6)")
                mark = md.get("audio_text_mark")
                nxt = evs[i + 1] if i + 1 < len(evs) else {}
                unit = md.get("model_unit_index", -1)
                after = resp.chars_through(unit) + len(nxt.get("delta") or "")
                if mark is None or mark.get("text_chars") != after:
                    bad(i, f"audio_text_mark.text_chars {mark} != {after} (§7.5)")
                if mark and md.get("audio_end_ms") != mark.get("audio_end_ms"):
                    bad(i, "audio_text_mark.audio_end_ms != metadata.audio_end_ms")
                if md.get("audio_start_ms") != resp.audio_ms:
                    bad(i, f"audio_start_ms {md.get('audio_start_ms')} != previous end {resp.audio_ms}")
                resp.audio_ms = md.get("audio_end_ms", resp.audio_ms)
            else:
                resp.transcript += ev.get("delta") or ""
                resp.unit_chars.append((md.get("model_unit_index", -1), len(ev.get("delta") or "")))
            resp.phase = max(resp.phase, 4)
            continue
        closing = ["response.output_audio.done", "response.output_audio_transcript.done", "response.output_text.done",
                   "response.content_part.done", "response.output_item.done", "conversation.item.done"]
        if t in closing and resp is not None:
            if resp.done_at is not None:
                bad(i, "closing event after response.done")
            resp.closing.append(t)
            if t == "response.output_audio_transcript.done" and ev.get("transcript") != resp.transcript:
                bad(i, "transcript.done != concatenation of sent deltas (C-5)")
            if t == "response.output_text.done" and ev.get("text") != resp.transcript:
                bad(i, "text.done != concatenation of sent deltas (C-5)")
            if t == "response.content_part.done":
                part = ev["part"]
                if part.get("transcript", part.get("text")) != resp.transcript:
                    bad(i, "content_part.done part text != sent deltas (C-5)")
            continue
        if t == "response.listen":
            unit = ev.get("model_unit_index")
            if unit is not None:
                if unit in listen_units:
                    bad(i, f"two listen decisions for unit {unit} (L1)")
                listen_units.add(unit)
            elif ev["response"]["metadata"].get("reason") != "non_speech_commit":
                bad(i, "only a non_speech_commit listen may lack model_unit_index (L1)")
            if rid is not None:
                if resp is None or resp is not active:
                    bad(i, "response.listen names a response that is not active")
                elif resp.spoke or resp.audio_deltas or resp.transcript:
                    bad(i, "listen terminates a response that already spoke (L4)")
                else:
                    resp.listened = True
            continue
        if t == "response.done" and resp is not None:
            r = ev["response"]
            if resp.done_at is not None:
                bad(i, "second response.done (C-2)")
            resp.done_at, resp.status, resp.phase = i, r["status"], 7
            _check_done(bad, i, resp, r)
            if r["status"] == "cancelled":
                dead_epoch = max(dead_epoch, resp.epoch)
            active = None if active is resp else active
            last_done = resp
            continue
        if t == "rate_limits.updated":
            if last_done is None or last_done.phase != 7 or evs[i - 1]["type"] != "response.done":
                bad(i, "rate_limits.updated not right after a response.done (R8)")
            else:
                last_done.phase = 8
            continue
        # ---- commit sequence Q1-Q4 (§3.7) ----
        if t == "input_audio_buffer.committed":
            commits[ev["item_id"]] = [t]
        elif t in ("conversation.item.added", "conversation.item.input_audio_transcription.completed",
                   "conversation.item.done"):
            item_id = ev.get("item_id") or ev.get("item", {}).get("id")
            seq_ = commits.get(item_id)
            if seq_ is not None:
                order = ["input_audio_buffer.committed", "conversation.item.added",
                         "conversation.item.input_audio_transcription.completed", "conversation.item.done"]
                if order.index(t) <= order.index(seq_[-1]):
                    bad(i, "commit sequence out of order (Q1-Q4)")
                seq_.append(t)
            elif t == "conversation.item.added":
                bad(i, "user item added without input_audio_buffer.committed first")
    for r in resps.values():
        if r.done_at is None and closed_at is not None:
            errs.append(f"response {r.rid} never reached response.done before session end (C-2)")
    for item_id, seq_ in commits.items():
        if seq_[-1] != "conversation.item.done":
            errs.append(f"commit of {item_id} did not finish with conversation.item.done (Q4)")
    return errs


def _response_of(ev: Json) -> str | None:
    t = ev["type"]
    if t == "response.done":
        return ev["response"]["id"]
    if t in ("conversation.item.added", "conversation.item.done") and ev["item"].get("role") == "assistant":
        return ev["item"]["id"][len("item_"):]
    rid = ev.get("response_id")
    return rid if isinstance(rid, str) else None


def _check_done(bad: Any, i: int, resp: _Resp, r: Json) -> None:
    """R5/R6 cardinality and the status table of §3.2."""
    expect: list[str] = []
    if resp.text_only:
        if resp.transcript:
            expect.append("response.output_text.done")
    else:
        if resp.audio_deltas:
            expect.append("response.output_audio.done")
        if resp.transcript:
            expect.append("response.output_audio_transcript.done")
    expect += ["response.content_part.done", "response.output_item.done", "conversation.item.done"]
    if resp.closing != expect:
        bad(i, f"R5/R6 of {resp.rid} were {resp.closing}, expected {expect}")
    duplex = r.get("duplex") or {}
    status, details = r["status"], r.get("status_details") or {}
    if details.get("type") != status:
        bad(i, "status_details.type != status")
    if status == "cancelled":
        reason = details.get("reason")
        if duplex.get("reason") in CLIENT_CANCEL_REASONS - {"session_close"} and reason != "client_cancelled":
            bad(i, f"client-caused cancel must have status_details.reason client_cancelled, got {reason}")
        if duplex.get("reason") == "turn_detected" and reason != "turn_detected":
            bad(i, "barge-in by policy must have status_details.reason turn_detected")
    if resp.listened and (status != "completed" or duplex.get("reason") != "model_listen"):
        bad(i, "a precreated response ended by listen must complete with reason model_listen (L4)")
    if resp.listened and resp.closing[:1] != ["response.content_part.done"]:
        bad(i, "L4: no R3-R5 for a listen-terminated response")
    out = r.get("output") or []
    if out:
        content = (out[0].get("content") or [{}])[0]
        text = content.get("transcript", content.get("text"))
        if text != resp.transcript:
            bad(i, "response.done output transcript != sent deltas (C-5)")
    if status == "completed" and out and out[0].get("status") != "completed":
        bad(i, "completed response with a non-completed item")
    if status == "cancelled" and out and out[0].get("status") != "incomplete":
        bad(i, "cancelled response item must be incomplete (K6)")
    if r.get("metadata") is not None and not all(isinstance(v, str) for v in r["metadata"].values()):
        bad(i, "response.metadata must be the client's string map")


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.gateway.conformance stream.jsonl [ga|beta]`: check a recorded stream (one event a line)."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    with open(args[0], encoding="utf-8") as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    errs = check(events, args[1] if len(args) > 1 else "ga")
    for e in errs:
        print(e)
    print(f"{len(events)} events, {len(errs)} violations")
    return 1 if errs else 0


if __name__ == "__main__":
    raise SystemExit(main())
