"""Does a session's output depend on who shares its batch? One session alone vs among N-1 others (issue 16).

The CUDA test tests/engine/test_stage0_bf16_batch.py asks this on the GPU; this script asks it anywhere, in the
serving configuration's shape: tiny model in bf16, graph sets (eager replay off CUDA), the chosen compile mode,
scripted-free sampling at temperature 1.5, 4 units. Prints whether the watched session's token ids are equal.

    python bench/stage0_batch_invariance.py --sessions 8 --compile default
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.stage0 import DecodeRules, Fence, SamplingParams, Stage0Config, Stage0Engine, TokenEvent  # noqa: E402
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer, unit_pcm  # noqa: E402

UNITS, WATCHED = 4, 1


def tokens(sids: list[int], sessions: int, compile_mode: str | None, device: str) -> dict[int, list[int]]:
    model = tiny_llm().to(device=device, dtype=torch.bfloat16)
    config = Stage0Config(max_sessions=sessions, compile_mode=compile_mode, decode_kv_buckets=(512,),
                          prefill_batch_buckets=(2, 8, 32), eager_replay_graphs=device == "cpu")
    events: list = []
    engine = Stage0Engine(model, tiny_tokenizer(), FakeFrontEnd(), events.append, config,
                          DecodeRules(force_listen_count=0))
    for i in sids:
        engine.open(f"s{i}", Fence(1, 0), params=SamplingParams(temperature=1.5, seed=i))
    for k in range(UNITS):
        for i in sids:
            engine.append(f"s{i}", Fence(1, 0, seq=k), unit_pcm(i, k))
        engine.run_until_idle()
    return {i: [e.token_id for e in events if isinstance(e, TokenEvent) and e.session_id == f"s{i}"] for i in sids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--compile", default="default", help="torch.compile mode, or 'none' for eager")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    mode = None if args.compile == "none" else args.compile
    t0 = time.perf_counter()
    crowd = tokens(list(range(args.sessions)), args.sessions, mode, args.device)[WATCHED]
    alone = tokens([WATCHED], args.sessions, mode, args.device)[WATCHED]
    first = next((i for i, (a, c) in enumerate(zip(alone, crowd, strict=False)) if a != c), None)
    verdict = "equal" if alone == crowd else f"DIFFER from token {first if first is not None else min(len(alone), len(crowd))}"
    print(f"device {args.device}, compile {args.compile}, {args.sessions} sessions: {len(alone)} tokens of the watched "
          f"session alone vs in the crowd: {verdict} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
