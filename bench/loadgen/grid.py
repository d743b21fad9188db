"""The gateway's model-unit grid, rebuilt on the client from the input it sent (protocol.md §8.6 U-1).

The gateway cuts the 16 kHz input into units: unit 0 = 16,480 samples, later units 16,000. A commit that
makes a final append (C1/C2/C8 of §3.7, `reason: "committed"`) pads the partial unit with silence and
submits it, so the next unit starts at the commit's input position (`committed.metadata.audio_end_ms`, the
input clock at the commit). A user that streams continuously and on time feeds no synthetic silence, so
the grid is exactly: regular units, restarted at every such commit. A commit whose padding position the
client cannot know (a deferred commit, promoted later) ends the grid's validity: `valid_until` then says
up to which input sample unit times are known.

This lets the load generator time a unit from the send of its last input chunk, whatever decision plan
the server follows, and lets a user of a scripted plan place its speech where the plan listens.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

INPUT_RATE = 16_000
FIRST_UNIT = 16_480
UNIT = 16_000


@dataclass
class UnitGrid:
    # (unit index, start sample): from each anchor on, units are regular (unit 0 is the longer first one)
    anchors: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0), (1, FIRST_UNIT)])
    valid_until: float = float("inf")  # input sample after which the grid is unknown

    def flush_at(self, pos: int) -> None:
        """A final-append commit at input sample `pos`: the unit holding it ends there (if it started)."""
        unit, start = self.unit_at(pos)
        if pos > start:
            self.anchors.append((unit + 1, pos))

    def lose_at(self, pos: int) -> None:
        self.valid_until = min(self.valid_until, pos)

    def unit_at(self, pos: int) -> tuple[int, int]:
        """(index, start sample) of the unit that holds input sample `pos`."""
        u0, s0 = self.anchors[bisect_right([s for _, s in self.anchors], pos) - 1]
        k = (pos - s0) // UNIT
        return u0 + k, s0 + k * UNIT

    def start(self, unit: int) -> int:
        u0, s0 = self.anchors[bisect_right([u for u, _ in self.anchors], unit) - 1]
        return s0 + (unit - u0) * UNIT

    def end(self, unit: int) -> int | None:
        """Input sample just past the unit's last one; None where the grid is unknown."""
        end = self.start(unit + 1)
        return end if end <= self.valid_until else None


def plan_speaks(plan: dict[str, int] | None, unit: int, force_listen: int) -> bool:
    """Whether a scripted plan (engine/stage0/script.py) speaks at this unit; forced units listen."""
    if plan is None or unit < force_listen:
        return False
    listen, speak = plan.get("listen_units", 10), plan.get("speak_units", 5)
    cycle = listen + speak + plan.get("tail_listen_units", 5)
    return 0 <= unit % cycle - listen < speak
