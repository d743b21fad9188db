"""Turn a checkpoint directory and a deploy profile into a ready Triton model repository.

    python build/make_model_repository.py --checkpoint DIR --profile deploy/profiles/default.yaml --out OUT

OUT gets one folder per model (stage0, tts, token2wav, duplex) with a generated config.pbtxt
(instances, max sessions as max_batch_size + parameters, device, dtype, KV window, checkpoint path,
sequence idle timeout) and the model.py copied from model_repository/, plus serve.json, a summary the
launcher reads. The profile is validated first: a bad value exits 2 with a message naming the field.
The checked-in model_repository/*/config.pbtxt are this script's output for the default profile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = REPO_ROOT / "model_repository"
STAGES = ("stage0", "tts", "token2wav")
PIPELINE = "duplex"
MODELS = (*STAGES, PIPELINE)
TORCH_ENGINES = "model_repository.common.bridges"  # the real engine/ stage engines
# `engine` names a module whose `stage0`, `tts` and `token2wav` callables are the engine factories:
# `torch` is the product's; tests serve stand-in engines by naming their own module.
ENGINE_MODULES = {"torch": TORCH_ENGINES}
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
PIPELINE_FACTORY = "model_repository.common.pipeline:PipelineModel"  # informational: BLS, no engine
DEFAULT_CHECKPOINT = "/checkpoints/MiniCPM-o-4_5"
US_PER_S = 1_000_000
# engine_options.stage0.scripted_decisions: a benchmark decision plan for random weights (ScriptPlan's fields)
SCRIPT_PLAN_KEYS = ("listen_units", "speak_units", "text_ids_per_unit", "tail_listen_units")
MPS_MODES = ("auto", "on", "off")


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class DeployProfile:
    engine: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    max_sessions: int = 4
    kv_window: int = 4096
    session_idle_ttl_s: float = 300.0
    sequence_idle_timeout_s: float = 360.0
    # the gateway's unit alignment period in seconds (passed to it as DUPLEX_UNIT_ALIGN_S; 0: off): after each
    # commit the next unit is cut short on a shared tick, so the sessions' units reach the stages together
    unit_align_s: float = 0.0
    # > 0: align only while at least this many sessions are live on the gateway (DUPLEX_UNIT_ALIGN_MIN_SESSIONS):
    # the unaligned latency at low load, the batched steps above it; 0: whenever unit_align_s > 0
    unit_align_min_sessions: int = 0
    stage0_instances: int = 1
    tts_instances: int = 1
    token2wav_instances: int = 1
    pipeline_instances: int = 1
    # stage -> engine options (JSON object handed to the stage's factory as `engine_options`), e.g.
    # {"tts": {"compile_step": true}, "stage0": {"compile_mode": "default"}, "token2wav": {"flow_dtype": "float16"}}
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # model -> GPU ids its instance_group names (device cuda only), e.g. {"stage0": [0], "tts": [1],
    # "token2wav": [1]}: Triton starts `<model>_instances` instances on EACH listed GPU and tells each
    # instance its GPU (StageSettings.instance_device). A model left out may run on any visible GPU.
    gpus: dict[str, list[int]] = field(default_factory=dict)
    # CUDA MPS for the stage processes (serve/mps.py): auto (a private daemon where several share a GPU), on, off.
    # YAML reads a bare on/off as true/false; both spellings are accepted.
    mps: str = "auto"
    # stage -> the share of the GPU's SMs (1..100 %) its processes may use under MPS
    # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, set in the stage process before CUDA starts), e.g. {"stage0": 70}: a cap
    # on stage0's large kernels leaves SMs free for the TTS and Token2Wav steps. A stage left out is not capped.
    mps_thread_percentage: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.mps, bool):
            object.__setattr__(self, "mps", "on" if self.mps else "off")
        checks = {
            "engine": _engine_module_exists(self.engine),
            "engine_options": isinstance(self.engine_options, dict) and set(self.engine_options) <= set(STAGES)
            and all(isinstance(v, dict) for v in self.engine_options.values())
            and _script_plan_ok(self.engine_options),
            "device": self.device.split(":")[0] in ("cpu", "cuda"),
            "gpus": _gpu_lists(self.gpus) and (not self.gpus or self.device == "cuda"),
            "mps": self.mps in MPS_MODES and (self.mps != "on" or self.device.startswith("cuda")),
            "mps_thread_percentage": _percentages(self.mps_thread_percentage)
            and (not self.mps_thread_percentage or self.device.startswith("cuda")),
            "dtype": self.dtype in ("float32", "bfloat16", "float16"),
            "max_sessions": _positive_int(self.max_sessions),
            "kv_window": _positive_int(self.kv_window),
            "session_idle_ttl_s": _positive_number(self.session_idle_ttl_s),
            "sequence_idle_timeout_s": _positive_number(self.sequence_idle_timeout_s)
            and self.sequence_idle_timeout_s >= self.session_idle_ttl_s,
            "unit_align_s": _non_negative_number(self.unit_align_s),
            "unit_align_min_sessions": _non_negative_int(self.unit_align_min_sessions),
            **{f"{s}_instances": _positive_int(getattr(self, f"{s}_instances")) for s in (*STAGES, "pipeline")},
        }
        for name, ok in checks.items():
            if not ok:
                raise ProfileError(f"deploy profile field {name!r} has a bad value {getattr(self, name)!r}"
                                   + _HINTS.get(name, ""))

    @classmethod
    def load(cls, path: Path, **overrides: Any) -> DeployProfile:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ProfileError(f"deploy profile {path}: cannot read: {exc}") from exc
        if not isinstance(data, dict):
            raise ProfileError(f"deploy profile {path}: top level must be a mapping")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProfileError(f"deploy profile {path}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


_HINTS = {
    "engine": " (torch, or a module path whose stage0/tts/token2wav are engine factories)",
    "engine_options": f" (a mapping of {', '.join(STAGES)} to option mappings; stage0's scripted_decisions is a "
                      f"mapping of {', '.join(SCRIPT_PLAN_KEYS)} to integers >= 0, speak_units >= 1)",
    "device": " (cpu, cuda or cuda:N)",
    "dtype": " (float32, bfloat16 or float16)",
    "sequence_idle_timeout_s": " (must be a number >= session_idle_ttl_s)",
    "unit_align_s": " (a number of seconds >= 0; 0: off)",
    "unit_align_min_sessions": " (an integer >= 0; 0: align whenever unit_align_s > 0)",
    "mps": f" ({', '.join(MPS_MODES)}; on needs device: cuda)",
    "mps_thread_percentage": f" (a mapping of {', '.join(STAGES)} to integers 1..100; needs device: cuda)",
    "gpus": f" (a mapping of {', '.join(MODELS)} to non-empty lists of distinct GPU ids >= 0; needs device: cuda)",
}


def _engine_module_exists(engine: Any) -> bool:
    """`engine` names an importable module (checked without importing it: no torch at build time)."""
    if not isinstance(engine, str) or not _MODULE_PATH.fullmatch(ENGINE_MODULES.get(engine, engine)):
        return False
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        return importlib.util.find_spec(ENGINE_MODULES.get(engine, engine)) is not None
    except ImportError:
        return False


def _script_plan_ok(options: dict[str, Any]) -> bool:
    """`stage0.scripted_decisions` (engine/stage0/script.py ScriptPlan), when present, is a well-formed plan."""
    plan = (options.get("stage0") or {}).get("scripted_decisions")
    if plan is None:
        return True
    return isinstance(plan, dict) and set(plan) <= set(SCRIPT_PLAN_KEYS) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in plan.values()) \
        and plan.get("speak_units", 1) >= 1


def _percentages(caps: Any) -> bool:
    return isinstance(caps, dict) and set(caps) <= set(STAGES) and all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 100 for v in caps.values())


def _gpu_lists(gpus: Any) -> bool:
    return isinstance(gpus, dict) and set(gpus) <= set(MODELS) and all(
        isinstance(ids, list) and ids and len(set(ids)) == len(ids)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) for ids in gpus.values())


def _instance_group(model: str, profile: DeployProfile) -> str:
    kind = "KIND_GPU" if profile.device.startswith("cuda") else "KIND_CPU"
    count = getattr(profile, f"{model}_instances" if model != PIPELINE else "pipeline_instances")
    ids = profile.gpus.get(model)
    gpus = f" gpus: [ {', '.join(str(i) for i in ids)} ]" if ids else ""
    return f"instance_group [ {{ count: {count} kind: {kind}{gpus} }} ]\n"


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _non_negative_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def _non_negative_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf


def _io_block() -> str:
    inputs = [("OP", "TYPE_STRING", "1", False), ("FENCE", "TYPE_INT64", "3", False),
              ("NEXT_FENCE", "TYPE_INT64", "3", True), ("PCM", "TYPE_FP32", "-1", True),
              ("FRAMES", "TYPE_STRING", "-1", True), ("FORCE_LISTEN", "TYPE_BOOL", "1", True),
              ("CONFIG", "TYPE_STRING", "1", True), ("TOKENS", "TYPE_INT64", "-1", True),
              ("HIDDEN", "TYPE_FP32", "-1", True)]
    outputs = [("EVENT", "TYPE_STRING", "1"), ("AUDIO", "TYPE_INT16", "-1"), ("TOKENS", "TYPE_INT64", "-1"),
               ("HIDDEN", "TYPE_FP32", "-1")]
    ins = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]{" optional: true" if o else ""} }}'
                     for n, t, d, o in inputs)
    outs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in outputs)
    return f"input [\n{ins}\n]\noutput [\n{outs}\n]\n"


def render_config(model: str, profile: DeployProfile, checkpoint: str) -> str:
    """config.pbtxt text of one model (decoupled Python backend, sequence batching, UINT64 CORRID)."""
    params = {"stage": model, "checkpoint_dir": checkpoint, "device": profile.device, "dtype": profile.dtype,
              "max_sessions": str(profile.max_sessions), "kv_window": str(profile.kv_window),
              "session_idle_ttl_s": str(profile.session_idle_ttl_s)}
    params["engine_factory"] = f"{ENGINE_MODULES.get(profile.engine, profile.engine)}:{model}" \
        if model != PIPELINE else PIPELINE_FACTORY
    if profile.mps_thread_percentage.get(model):
        params["mps_thread_percentage"] = str(profile.mps_thread_percentage[model])
    options = dict(profile.engine_options.get(model) or {})
    tts = profile.engine_options.get("tts") or {}
    if model == "token2wav" and tts.get("first_codes"):  # the TTS sends first codes early: Token2Wav warms up
        options["head_codes"] = tts["first_codes"]        # their shapes (and renders mid-turn heads, if it sends them)
        if tts.get("head_every_unit"):
            options["head_every_unit"] = tts["head_every_unit"]
    if options:
        params["engine_options"] = json.dumps(options, sort_keys=True).replace('"', '\\"')
    param_text = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    idle_us = int(profile.sequence_idle_timeout_s * US_PER_S)
    return (
        f"# Generated by build/make_model_repository.py; edit the deploy profile, not this file.\n"
        f'name: "{model}"\nbackend: "python"\nmax_batch_size: {profile.max_sessions}\n'
        f"model_transaction_policy {{ decoupled: true }}\n"
        f"sequence_batching {{\n  max_sequence_idle_microseconds: {idle_us}\n  direct {{ }}\n  control_input [\n"
        f'    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},\n'
        f'    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},\n'
        f'    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }},\n'
        f'    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}\n'
        f"  ]\n}}\n{_io_block()}"
        f"{_instance_group(model, profile)}"
        f"parameters [\n{param_text}\n]\n"
    )


def build_repository(checkpoint: str, profile: DeployProfile, out: Path, models: tuple[str, ...] = MODELS) -> Path:
    if out.exists():
        shutil.rmtree(out)
    for model in models:
        (out / model / "1").mkdir(parents=True)
        (out / model / "config.pbtxt").write_text(render_config(model, profile, checkpoint))
        shutil.copy2(SOURCE / model / "1" / "model.py", out / model / "1" / "model.py")
    summary = {"models": list(models), "checkpoint": checkpoint, "profile": asdict(profile)}
    (out / "serve.json").write_text(json.dumps(summary, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="checkpoint directory (config.json, weights)")
    ap.add_argument("--profile", type=Path, default=REPO_ROOT / "deploy" / "profiles" / "default.yaml")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="only validate the profile")
    ap.add_argument("--json", action="store_true", help="with --check: print the profile as JSON")
    ap.add_argument("--max-sessions", type=int, default=None)
    ap.add_argument("--engine", default=None, help="override the profile's engine (torch, or a factory module path)")
    args = ap.parse_args(argv)
    try:
        profile = DeployProfile.load(args.profile, max_sessions=args.max_sessions, engine=args.engine)
    except (ProfileError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps(asdict(profile)) if args.json else f"deploy profile {args.profile} is valid")
        return 0
    if args.out is None:
        ap.error("--out is required")
    ckpt = str(Path(args.checkpoint).resolve()) if args.checkpoint != DEFAULT_CHECKPOINT else args.checkpoint
    build_repository(ckpt, profile, args.out)
    print(f"model repository ready: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
