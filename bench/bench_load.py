"""Full-size dummy load: load time, memory per component, one finite forward of every component.

Writes the real-size `config.json` of model.md §8.2 (and nothing else) into a temp dir, then
`load_checkpoint(dir, dummy=True, device, dtype)` builds every component at full size with the §9.4
recipe (§9.5) plus the full-size dummy Token2Wav. Memory per component is read off the loader's log
records (`device_bytes`: the CUDA allocator's growth while that component was materialised) beside
the parameter and buffer bytes of each module. Then one forward each, outputs checked finite:
  llm      prefill of `--llm-positions` positions + lm_head at the last one
  audio    one streaming unit (100 + 2·2 redundancy mel frames) + projector/pool
  vision   one 448² frame through SigLIP and the resampler
  tts      condition rows + audio_bos (prefill, logits), then one code step
  flow     one 28-code stream chunk after a `--prompt-tokens` voice prompt
  hift     that chunk's mel to 24 kHz audio
Each forward runs twice (cold, then warm; synchronised host clocks). Prints a table last, writes JSON.

    python bench/bench_load.py                    # H200: full size, bf16
    python bench/bench_load.py --tiny             # CPU smoke run on the tiny checkpoint (built here)
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
# NOTE: build/ goes on sys.path and its modules are imported by name: `build` is also a PyPI package.
for _p in (str(_ROOT), str(_ROOT / "build")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from tiny_checkpoint_files import TINY_CONFIG  # noqa: E402

from engine.audio.framing import StreamConfig as MelStreamConfig  # noqa: E402
from engine.loader import LoadedCheckpoint, load_checkpoint  # noqa: E402
from engine.model.layers import SlotKVCache  # noqa: E402
from engine.model.vision import encode_frame  # noqa: E402
from engine.token2wav.config import StreamConfig  # noqa: E402
from engine.token2wav.stream import PendingCall, new_session, run_flow_batch  # noqa: E402
from engine.token2wav.voice import build_voice_cache  # noqa: E402
from engine.voice import make_random_voice  # noqa: E402

# model.md §8.2: the real values, over the tiny file's schema (which carries every real key).
FULL_LLM = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151748, "max_window_layers": 36,
            "torch_dtype": "bfloat16"}
FULL_AUDIO = {"d_model": 1024, "encoder_layers": 24, "encoder_attention_heads": 16, "encoder_ffn_dim": 4096}
FULL_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
               "image_size": 980}
FULL_TTS = {"llm_dim": 4096, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 20,
            "num_attention_heads": 12, "num_key_value_heads": 12, "num_text_tokens": 152064,
            "audio_bos_token_id": 151687, "text_eos_token_id": 151692}
FRAME_SIDE = 448       # the duplex frame (model.md §1.4): one 32 x 32-patch slice
TTS_TEXT_ROWS = 10     # condition rows before audio_bos
LOG_NAME = "engine.loader.checkpoint"
_MIB = 1 << 20


def full_size_config() -> dict[str, Any]:
    """The real-size config.json of model.md §8.2 as a dict."""
    data = copy.deepcopy(TINY_CONFIG) | FULL_LLM
    data["audio_config"] = data["audio_config"] | FULL_AUDIO
    data["vision_config"] = data["vision_config"] | FULL_VISION
    data["tts_config"] = data["tts_config"] | FULL_TTS
    return data


def write_full_size_config(out: Path) -> Path:
    """A checkpoint dir holding only the real-size config.json (enough for a dummy load)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(full_size_config(), indent=2, sort_keys=True) + "\n")
    return out


class _Records(logging.Handler):
    """Collects the loader's per-component records (`extra` component / bytes / device_bytes)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_component: dict[str, dict[str, Any]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "component"):
            self.by_component[record.component] = {"bytes": getattr(record, "bytes", None),
                                                   "device_bytes": getattr(record, "device_bytes", None)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module_row(name: str, module: torch.nn.Module, logged: dict[str, Any] | None) -> dict[str, Any]:
    params = sum(p.numel() for p in module.parameters())
    return {"component": name, "params": params,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in module.buffers()),
            "device_bytes": None if logged is None else logged["device_bytes"]}


def forwards(ck: LoadedCheckpoint, args: argparse.Namespace) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """name -> a closure running one forward and returning the tensors that must be finite."""
    m, cfg, dev, dtype = ck.model, ck.config, ck.device, ck.dtype
    g = torch.Generator().manual_seed(0)
    out: dict[str, Callable[[], list[torch.Tensor]]] = {}

    def llm() -> list[torch.Tensor]:
        n = args.llm_positions
        kv = SlotKVCache.allocate(cfg.llm, 1, n + 1, dtype=dtype, device=dev)
        ids = torch.randint(0, cfg.llm.vocab_size, (1, n), generator=g).to(dev)
        hidden = m.llm(m.llm.embed(ids), torch.arange(n, device=dev)[None], torch.tensor([0], device=dev), kv)
        return [hidden, m.llm.logits(hidden[:, -1])]

    def audio() -> list[torch.Tensor]:
        fr = MelStreamConfig()
        extra = fr.redundancy_frames
        mel = torch.randn(1, cfg.audio.num_mel_bins, fr.chunk_frames + 2 * extra, generator=g).to(dev)
        hidden = m.apm.forward_stream(mel, m.apm.allocate_cache(), extra, extra)  # [1, 50, d]
        return [hidden, m.audio_projection_layer.embed(hidden, cfg.audio.audio_pool_step)]

    def vision() -> list[torch.Tensor]:
        frame = torch.randint(0, 256, (FRAME_SIDE, FRAME_SIDE, 3), generator=g, dtype=torch.uint8)
        return [encode_frame(m.vpm, m.resampler, frame)]

    def tts() -> list[torch.Tensor]:
        t = m.tts
        ids = torch.randint(0, cfg.llm.vocab_size, (1, TTS_TEXT_ROWS), generator=g).to(dev)
        llm_hidden = torch.randn(1, TTS_TEXT_ROWS, cfg.tts.llm_dim, generator=g).to(dev, dtype)
        cond = torch.cat([t.condition(ids, llm_hidden), t.audio_bos_row()[None, None]], dim=1)  # [1, n + 1, H]
        kv = SlotKVCache.allocate(cfg.tts, 1, TTS_TEXT_ROWS + 2, dtype=dtype, device=dev)
        slot = torch.tensor([0], device=dev)
        h0 = t(cond, torch.arange(TTS_TEXT_ROWS + 1, device=dev)[None], slot, kv)
        logits0 = t.logits(h0[:, -1])
        code = logits0.argmax(-1)  # greedy: this checks the arithmetic, not the sampler
        h1 = t(t.embed_codes(code)[:, None], torch.full((1, 1), TTS_TEXT_ROWS + 1, device=dev), slot, kv)
        return [h0, logits0, t.logits(h1[:, 0])]

    out["llm_prefill"], out["audio_unit"], out["tts_condition_step"] = llm, audio, tts
    if m.vpm is not None:
        out["vision_frame"] = vision
    t2w = ck.token2wav
    if t2w is not None:
        scfg = StreamConfig()
        voice = make_random_voice(codebook=t2w.flow_cfg.vocab_size, num_tokens=args.prompt_tokens)
        session = new_session(t2w, build_voice_cache(t2w.flow, voice, scfg), scfg, seed=0)
        codes = torch.randint(0, t2w.flow_cfg.vocab_size, (scfg.chunk_new,), generator=g).tolist()
        last_call: list[PendingCall] = []

        def flow() -> list[torch.Tensor]:
            session.reset_turn()
            call = session.plan_unit(codes, end_of_turn=False).calls[0]  # silence prefix + 25 codes
            run_flow_batch(t2w, [session], [call])
            last_call[:] = [call]
            return [call.mel]

        def hift() -> list[torch.Tensor]:
            mel, src, ini, noise = session.hift_inputs(last_call[0])
            return list(t2w.hift(mel, src, ini, noise))

        out["flow_chunk"], out["hift_chunk"] = flow, hift
    return out


@torch.inference_mode()
def run_forward(name: str, fn: Callable[[], list[torch.Tensor]], device: torch.device) -> dict[str, Any]:
    times, outs = [], []
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):  # cold, warm
        _sync(device)
        t0 = time.perf_counter()
        outs = fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return {"forward": name, "shapes": [list(o.shape) for o in outs], "cold_ms": times[0], "warm_ms": times[1],
            "finite": all(bool(torch.isfinite(o.float()).all()) for o in outs), "peak_extra_bytes": peak}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / _MIB:.1f}"


def print_tables(res: dict[str, Any]) -> None:
    print(f"\nload {res['load_seconds']:.2f} s  device {res['device']}  dtype {res['dtype']}  tiny {res['tiny']}")
    print(f"{'component':<24}{'params':>14}{'param MiB':>12}{'buffer MiB':>12}{'device MiB':>12}")
    for r in res["components"]:
        print(f"{r['component']:<24}{r['params']:>14,}{_mib(r['param_bytes']):>12}{_mib(r['buffer_bytes']):>12}"
              f"{_mib(r['device_bytes']):>12}")
    print(f"\n{'forward':<22}{'cold ms':>10}{'warm ms':>10}{'peak+ MiB':>11}  finite  output shapes")
    for r in res["forwards"]:
        print(f"{r['forward']:<22}{r['cold_ms']:>10.1f}{r['warm_ms']:>10.1f}{_mib(r['peak_extra_bytes']):>11}  "
              f"{str(r['finite']):<6}  {r['shapes']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint (built here), CPU unless --device")
    ap.add_argument("--device", default="")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--no-vision", action="store_true")
    ap.add_argument("--llm-positions", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="voice prompt codes (0: 250 = 10 s, tiny 8)")
    ap.add_argument("--out", default="out/bench_load.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    args.prompt_tokens = args.prompt_tokens or (8 if args.tiny else 250)
    records = _Records()
    logger = logging.getLogger(LOG_NAME)
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from make_tiny_checkpoint import build_tiny_checkpoint

            path = build_tiny_checkpoint(Path(tmp) / "tiny", 0, vision=not args.no_vision)
        else:
            path = write_full_size_config(Path(tmp) / "full")
        _sync(device)
        t0 = time.perf_counter()
        ck = load_checkpoint(path, dummy=True, device=device, dtype=dtype, with_vision=not args.no_vision)
        _sync(device)
        load_s = time.perf_counter() - t0
    logger.removeHandler(records)
    logger.setLevel(level)
    logged = records.by_component
    rows = [_module_row(n, mod, logged.get(n)) for n, mod in ck.model.components().items()]
    if ck.token2wav is not None:  # split records from a dummy build; one "token2wav" record from assets
        rows += [_module_row(n, getattr(ck.token2wav, n.split(".")[1]), logged.get(n))
                 for n in ("token2wav.flow", "token2wav.hift")]
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": args.dtype,
        "tiny": args.tiny, "load_seconds": load_s, "components": rows,
        "total_param_bytes": sum(r["param_bytes"] for r in rows),
        "token2wav_assets_device_bytes": logged.get("token2wav", {}).get("device_bytes"),
        "allocated_after_load": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
        "forwards": [run_forward(n, fn, device) for n, fn in forwards(ck, args).items()],
    }
    if device.type == "cuda":
        res["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    print_tables(res)
    return res


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if all(f["finite"] for f in result["forwards"]) else 1)
