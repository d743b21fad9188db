"""A fake runtime that answers like a turn-taking model: it listens while the user speaks and, after a
unit of silence that follows speech, speaks `answer_units` units (the last one ends the turn). Speech that
overlaps an answer does not stop it (as with `overlap_policy: listen_only`); a cancel does.

Built on the gateway helper's `FakeRuntime` (fenced appends, cancel F-1..F-5); only the decision differs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.gateway.fake_runtime import FakeRuntime, Speak

SPEECH_RMS = 0.01  # unit RMS (samples in [-1, 1]) above which the fake "hears" speech


class ReactiveRuntime(FakeRuntime):
    def __init__(self, answer_units: int = 2, answers: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.answer_units = answer_units
        self.answers = answers
        self.answered = 0
        self._heard_speech = False
        self._remaining = 0

    def _next_text(self) -> str:
        if self.answered < len(self.answers):
            return self.answers[self.answered]
        return f"This is answer number {self.answered + 1} from the fake model."

    async def append(self, key: Any, fence: Any, unit: Any) -> None:
        x = np.frombuffer(unit.pcm, dtype="<f4")
        loud = bool(len(x)) and float(np.sqrt(np.mean(x * x))) > SPEECH_RMS
        if loud:
            self._heard_speech = self._remaining == 0  # overlap while answering is not a new question
        elif self._heard_speech:
            self._heard_speech, self._remaining = False, self.answer_units
            self._text = self._next_text()
            self.answered += 1
        if self._remaining > 0:
            words = self._text.split(" ")
            k = self.answer_units - self._remaining
            part = " ".join(words[k * len(words) // self.answer_units:(k + 1) * len(words) // self.answer_units])
            self.plan[unit.unit_index] = Speak(part + " ", 1000, end_of_turn=self._remaining == 1,
                                               tokens=max(1, min(3, len(part))))
            self._remaining -= 1
        await super().append(key, fence, unit)

    async def cancel(self, key: Any, fence: Any, next_fence: Any) -> None:
        self._remaining = 0  # the cancelled turn is over (F-5); the next answer follows new speech
        await super().cancel(key, fence, next_fence)
