"""`DuplexClient` against the real stack (tritonserver + gateway), started separately:

    duplex serve --port 8000 &
    DUPLEX_TEST_GATEWAY_URL=http://127.0.0.1:8000 python -m pytest tests/clients -m e2e -q
"""

import shutil
import subprocess

import numpy as np
import pytest

from clients import DuplexClient
from clients.audio import read_wav, silence
from clients.events import ResponseListen

pytestmark = pytest.mark.e2e
ANSWER_WINDOW_MS = 8000  # real-time silence streamed after the question while the model decides


def _question(tmp_path) -> np.ndarray:
    if not shutil.which("espeak-ng"):
        pytest.skip("espeak-ng is needed to synthesise the question")
    wav = tmp_path / "q.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "What is the capital of France?"], check=True)  # noqa: ASYNC221
    return read_wav(wav, 16000)[0]


async def test_spoken_question_through_the_real_stack(real_gateway_url: str, tmp_path) -> None:
    question = _question(tmp_path)
    async with DuplexClient(real_gateway_url) as c:
        await c.stream(np.concatenate([question, silence(500)]), last_label="speech_end")
        await c.commit()
        await c.stream(silence(ANSWER_WINDOW_MS))  # continuous client: the model keeps its units
        decisions = [ev for ev in c.history if isinstance(ev, ResponseListen) or ev.type == "response.created"]
        assert decisions, "no unit decision came back from the runtime"
        for resp in list(c.responses.values()):
            done = await resp.wait_done(60)
            assert done.status in ("completed", "incomplete", "cancelled")
            if resp.audio_ms:
                await resp.ack(int(resp.audio_ms))
                timing = c.collector.response_summary(resp.response_id)
                assert "0" in timing["engine"] and timing["client"]["response_created_to_first_audio_ms"] >= 0
        assert not c.errors(), [e.raw for e in c.errors()]
    assert c.history[-1].type == "session.closed"
