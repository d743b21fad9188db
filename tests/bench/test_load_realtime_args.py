"""bench/load_realtime.py's arguments: `--unit-align-s` (the load generator's grid follows the gateway's, which the
deploy profile's `unit_align_s` sets unless an explicit value is given) and `--instructions-chars`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = ["--url", "ws://x:1", "--duration", "5", "--out", "r.json"]


@pytest.fixture(name="parse")
def _parse() -> Callable[..., argparse.Namespace]:
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import load_realtime  # noqa: PLC0415 - a script, importable once bench/ is on the path

    return lambda *extra: load_realtime.parse_args([*BASE, *extra])


def _profile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_the_default_is_the_profiles_unit_align_s(tmp_path: Path, parse: Callable[..., argparse.Namespace]) -> None:
    assert parse("--profile", str(_profile(tmp_path, "unit_align_s: 1.5\n"))).unit_align_s == 1.5
    assert parse("--profile", str(REPO / "deploy" / "profiles" / "h200-64-scripted.yaml")).unit_align_s == 1.0


def test_the_alignment_floor_comes_from_the_profile_unless_given(tmp_path: Path,
                                                                 parse: Callable[..., argparse.Namespace]) -> None:
    profile = str(_profile(tmp_path, "unit_align_s: 1.0\nunit_align_min_sessions: 24\n"))
    assert parse("--profile", profile).unit_align_min_sessions == 24
    assert parse("--profile", profile, "--unit-align-min-sessions", "0").unit_align_min_sessions == 0
    assert parse().unit_align_min_sessions == 0


def test_off_without_a_profile_or_without_the_key(tmp_path: Path, parse: Callable[..., argparse.Namespace]) -> None:
    assert parse().unit_align_s == 0.0
    assert parse("--profile", str(_profile(tmp_path, "max_sessions: 4\n"))).unit_align_s == 0.0


@pytest.mark.parametrize("explicit", ["0", "0.5"])
def test_an_explicit_value_wins_over_the_profile(tmp_path: Path, parse: Callable[..., argparse.Namespace],
                                                explicit: str) -> None:
    args = parse("--profile", str(_profile(tmp_path, "unit_align_s: 1.0\n")), "--unit-align-s", explicit)
    assert args.unit_align_s == float(explicit)


def test_an_unreadable_profile_is_a_usage_error(tmp_path: Path, parse: Callable[..., argparse.Namespace],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse("--profile", str(_profile(tmp_path, "unit_align_s: soon\n")))
    assert exit_.value.code == 2
    assert "cannot read unit_align_s from --profile" in capsys.readouterr().err


def test_instructions_chars_is_bounded_by_the_protocol(parse: Callable[..., argparse.Namespace],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert parse().instructions_chars == 0
    assert parse("--instructions-chars", "6000").instructions_chars == 6000
    for bad in ("-1", "32769"):
        with pytest.raises(SystemExit) as exit_:
            parse("--instructions-chars", bad)
        assert exit_.value.code == 2
    assert "--instructions-chars must be 0..32768" in capsys.readouterr().err


def test_long_instructions_fill_the_session_update() -> None:
    from bench.loadgen.user import SESSION_CONFIG, long_instructions, session_config

    text = long_instructions(5000)
    assert len(text) == 5000 and text.startswith("The caller") and len(set(text.split())) > 5
    body = session_config(text)
    assert body["instructions"] == text and {k: v for k, v in body.items() if k != "instructions"} == SESSION_CONFIG
    assert "instructions" not in session_config() and "instructions" not in SESSION_CONFIG
