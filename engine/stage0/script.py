"""`scripted_decisions` (model.md §9.5): benchmark-only replacement of the sampled id.

Random weights make decisions meaningless, so a benchmark session follows a script: every forward, logits
and sampling kernel still runs, only the chosen id is swapped before the decode rules see it. The
default cycle: `listen_units` listen units, then a turn of `speak_units` speak units, each `<|speak|>` +
`text_ids_per_unit` text ids + `<|chunk_eos|>` (the last one puts `<|turn_eos|>` before its
`<|chunk_eos|>`), then `tail_listen_units` listen units; repeat. Text ids are drawn uniformly from the
non-special ids with a generator seeded by (session seed, unit index), so a script is reproducible and
independent of batching.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from engine.stage0.config import ScriptPlan, SpecialIds  # the plan is config; re-exported here


class DecisionScript:
    def __init__(self, ids: SpecialIds, detokenize: Callable[[list[int]], str], vocab_size: int,
                 plan: ScriptPlan | None = None) -> None:
        self.ids, self.detokenize, self.vocab_size = ids, detokenize, vocab_size
        self.plan = plan or ScriptPlan()
        specials = {v for v in vars(ids).values() if isinstance(v, int)}
        self._excluded = specials | set(ids.bad_token_ids)
        self._units: dict[tuple[int, int], tuple[int, ...]] = {}

    def is_text(self, token: int) -> bool:
        """A non-special id: not a named special or bad id, and visible in the transcript (decode skips
        special tokens, so a special id decodes to "")."""
        return token not in self._excluded and self.detokenize([token]) != ""

    def unit(self, seed: int, unit_index: int) -> tuple[int, ...]:
        """The ids the unit's sampled steps j = 0, 1, … produce, its terminator last."""
        key = (seed, unit_index)
        if key not in self._units:
            self._units[key] = self._build(seed, unit_index)
        return self._units[key]

    def choose(self, seed: int, unit_index: int, j: int, sampled: int) -> int:
        """The id to use in place of `sampled` at step j. Past the script (a decode rule changed the
        course, e.g. a cancel left the turn open), the unit closes on `<|chunk_eos|>`."""
        del sampled  # computed by the real kernels; only replaced here
        script = self.unit(seed, unit_index)
        return script[j] if j < len(script) else self.ids.chunk_eos

    def _build(self, seed: int, unit_index: int) -> tuple[int, ...]:
        p, ids = self.plan, self.ids
        k = unit_index % p.cycle - p.listen_units  # index within the turn's speak units
        if not 0 <= k < p.speak_units:
            return (ids.listen,)
        rng = random.Random(f"{seed}:{unit_index}")  # str seeds are stable across processes
        text: list[int] = []
        while len(text) < p.text_ids_per_unit:
            t = rng.randrange(self.vocab_size)
            if self.is_text(t):
                text.append(t)
        end = (ids.turn_eos, ids.chunk_eos) if k == p.speak_units - 1 else (ids.chunk_eos,)
        return (ids.speak, *text, *end)
