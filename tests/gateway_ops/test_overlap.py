from __future__ import annotations

import pytest

from gateway.vad.overlap import OverlapChunk, OverlapEpisode, client_action

SHORT, LONG = 700, 1200


def run(policy: str, chunks: list[OverlapChunk]) -> list[tuple[str, str, int, bool]]:
    ep = OverlapEpisode()
    out = []
    for c in chunks:
        d = ep.decide(c, policy=policy, short_ack_ms=SHORT, barge_in_ms=LONG)
        out.append((d.action, d.reason, int(d.overlap_ms), d.emit))
    return out


def speech(ms: float = 200, **kw: object) -> OverlapChunk:
    return OverlapChunk(is_speech=True, duration_ms=ms, **kw)


def silence(ms: float = 200) -> OverlapChunk:
    return OverlapChunk(is_speech=False, duration_ms=ms)


@pytest.mark.parametrize(("raw", "force", "expected"), [
    ("interrupt", None, "barge_in"), ("CANCEL", None, "barge_in"), ("continue", None, "listen"),
    ("ack", None, "listen"), ("silence", None, "drop"), ("ignore", None, "drop"), (None, True, "barge_in"),
    ("listen", True, "barge_in"), (None, None, None), ("bogus", None, None),
])
def test_client_action_groups(raw: str | None, force: bool | None, expected: str | None) -> None:
    assert client_action(raw, force) == expected


def test_o1_client_verdict_wins_in_every_policy() -> None:
    for policy in ("listen_only", "barge_in_on_speech", "auto"):
        assert run(policy, [OverlapChunk(False, 200, client_action="drop")])[0][:2] == ("drop", "client_overlap_action")


def test_o2_non_speech_before_episode_is_not_emitted() -> None:
    assert run("auto", [silence()]) == [("ignore", "non_speech", 0, False)]


def test_o3_listen_only_reasons() -> None:
    assert run("listen_only", [speech()])[0][:2] == ("listen", "auto_response_continuous")
    assert run("listen_only", [speech(auto_response=False)])[0][:2] == ("listen", "listen_only_policy")


def test_o3_emits_on_first_and_on_change_only() -> None:
    got = run("listen_only", [speech(), speech(), silence(), silence(), speech()])
    assert [g[3] for g in got] == [True, False, True, False, True]
    assert [g[2] for g in got] == [200, 400, 400, 400, 600]  # non-speech does not count in overlap_ms


def test_o4_vad_onset_barges_in_and_ends_episode() -> None:
    got = run("barge_in_on_speech", [speech(vad_on=True), speech(vad_on=True, onset_confirmed=True),
                                     speech(vad_on=True)])
    assert got[0] == ("listen", "overlap_pending", 200, True)  # O6: VAD on, no onset yet
    assert got[1] == ("barge_in", "server_vad_utterance_active", 400, True)
    assert got[2] == ("listen", "overlap_pending", 200, True)  # a new episode


def test_o5_o6_long_overlap_without_vad() -> None:
    got = run("barge_in_on_speech", [speech(400), speech(400), speech(400)])
    assert [g[:2] for g in got] == [("listen", "overlap_pending")] * 2 + [("barge_in", "long_overlap_speech")]
    assert got[2][2] == 1200 and got[2][3]


def test_o7_o8_o9_auto_thresholds() -> None:
    got = run("auto", [speech(700), speech(1), speech(498), speech(1)])
    assert [g[:2] for g in got] == [("listen", "short_overlap"), ("listen", "overlap_pending"),
                                    ("listen", "overlap_pending"), ("barge_in", "long_overlap_speech")]
    assert [g[2] for g in got] == [700, 701, 1199, 1200]
    assert [g[3] for g in got] == [True, True, False, True]


def test_end_resets_episode() -> None:
    ep = OverlapEpisode()
    ep.decide(speech(1000), policy="auto", short_ack_ms=SHORT, barge_in_ms=LONG)
    ep.end()
    d = ep.decide(speech(100), policy="auto", short_ack_ms=SHORT, barge_in_ms=LONG)
    assert (d.action, d.reason, d.overlap_ms, d.emit) == ("listen", "short_overlap", 100, True)


def test_event_payload() -> None:
    ep = OverlapEpisode()
    d = ep.decide(OverlapChunk(True, 250, client_action="drop"), policy="auto", short_ack_ms=SHORT,
                  barge_in_ms=LONG)
    ev = d.event(session_id="s", epoch=3, response_id="resp_1", policy="auto")
    assert ev == {"type": "overlap.decision", "session_id": "s", "epoch": 3, "response_id": "resp_1",
                  "policy": "auto", "action": "drop", "reason": "client_overlap_action",
                  "metadata": {"overlap_ms": 250, "buffer_audio": False, "defer_runtime_append": False,
                               "force_listen": False}}
