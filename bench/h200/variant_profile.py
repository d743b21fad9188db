"""A deploy profile that differs from another in the named settings, for the A/B serves of bench/h200/ab_run.sh.

    python bench/h200/variant_profile.py BASE OUT KEY=VALUE [KEY=VALUE ...]

KEY is a dotted path into the profile (`engine_options.stage0.decode_attention`), VALUE is read as YAML (`matmul`,
`false`, `32`, `{tts: 50}`); the value `null` removes the key. OUT is checked as `duplex serve` checks a profile
(build/make_model_repository.py), and each stage's engine options against the names its bridge accepts, so a
misspelled field or option fails here, not on the device after its install and warm-up. Until stop
39 each device call made its variants with `sed` on the profile's text, which depended on the exact spacing of a
line (an unmatched pattern leaves the profile as it was, and the A/B then compares a profile with itself).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

try:
    from build.make_model_repository import DeployProfile, ProfileError
except ModuleNotFoundError:  # pypa's `build` installed shadows the repository's (the H100 device's venv, stop 51)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))
    from make_model_repository import DeployProfile, ProfileError


def apply(data: dict[str, Any], key: str, value: Any) -> None:
    """Set (or with None remove) the dotted `key` in `data`, making the mappings on its way."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ProfileError(f"{key}: {part!r} holds {child!r}, not a mapping")
        node = child
    if value is None:
        if leaf not in node:
            raise ProfileError(f"{key}: not in the profile, nothing to remove")
        del node[leaf]
    else:
        node[leaf] = value


def check_engine_options(data: dict[str, Any]) -> None:
    """Every stage's engine option is one its Triton bridge accepts (an unknown one fails the stage's load)."""
    from model_repository.common.bridges import stage0_bridge, token2wav_bridge, tts_bridge

    known = {"stage0": stage0_bridge.OPTIONS, "tts": tts_bridge.OPTIONS, "token2wav": token2wav_bridge.OPTIONS}
    for stage, opts in (data.get("engine_options") or {}).items():
        unknown = sorted(set(opts) - set(known.get(stage, ())))
        if unknown:
            raise ProfileError(f"engine_options.{stage}: unknown option(s) {unknown}; known: {list(known[stage])}")


def variant(base: Path, out: Path, settings: list[str]) -> dict[str, Any]:
    """Write OUT = BASE with `settings` (KEY=VALUE) applied, checked as a deploy profile; returns its data.
    Nothing is written when a setting or the result is bad."""
    result = copy.deepcopy(yaml.safe_load(base.read_text()) or {})
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ProfileError(f"{item!r}: expected KEY=VALUE")
        apply(result, key, yaml.safe_load(raw) if raw else None)
    header = f"# {base} with {' '.join(settings)} (bench/h200/variant_profile.py)\n"
    out.write_text(header + yaml.safe_dump(result, sort_keys=False))
    try:
        DeployProfile.load(out)
        check_engine_options(result)
    except ProfileError:
        out.unlink()
        raise
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("settings", nargs="+", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        variant(args.base, args.out, args.settings)
    except ProfileError as exc:
        sys.exit(f"variant_profile: {exc}")
    print(f"{args.out}: {args.base} with {' '.join(args.settings)}")


if __name__ == "__main__":
    main()
