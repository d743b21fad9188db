"""Headless Debian Chromium driven over the Chrome DevTools Protocol (no downloaded browser, no playwright).

`Browser.launch(fake_mic_wav)` starts /usr/bin/chromium with a fake microphone fed from a WAV file; `page`
exposes `navigate`, `evaluate` (with a user gesture, so AudioContexts may start) and `screenshot`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import websockets

from tests.e2e.stack import Proc

CHROMIUM = "/usr/bin/chromium"
START_TIMEOUT_S = 20.0
LAUNCH_TIMEOUT_S = 60.0  # a loaded 2-core CI machine; a start normally takes 0.3 s
LAUNCH_TRIES = 3  # a headless start now and then dies before it writes its port (a CI run did)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
         "--use-fake-device-for-media-stream", "--remote-debugging-port=0", "--window-size=1280,900")


def available() -> bool:
    return shutil.which(CHROMIUM) is not None


class Page:
    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self.console: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), START_TIMEOUT_S))
            if msg.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                             for a in msg["params"]["args"]))
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("EXCEPTION " + json.dumps(msg["params"]["exceptionDetails"])[:500])
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def navigate(self, url: str) -> None:
        await self.call("Page.enable")
        await self.call("Runtime.enable")
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True, userGesture=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page exception: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = START_TIMEOUT_S, poll_s: float = 0.1) -> Any:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise TimeoutError(f"page condition not met: {expression}")
            await asyncio.sleep(poll_s)

    async def screenshot(self, path: Path) -> Path:
        result = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))  # noqa: ASYNC240
        return path


@contextlib.asynccontextmanager
async def launch(fake_mic_wav: Path) -> AsyncIterator[Page]:
    failures: list[str] = []
    for _ in range(LAUNCH_TRIES):
        profile = Path(tempfile.mkdtemp(prefix="chromium-profile-"))
        # its own process group, output in a log, stopped with its renderers (the e2e stack's process handling)
        proc = Proc([CHROMIUM, *FLAGS, f"--user-data-dir={profile}",
                     f"--use-file-for-fake-audio-capture={fake_mic_wav}", "about:blank"],
                    profile.parent / f"{profile.name}.log", dict(os.environ))
        proc.start()
        try:
            port = await _devtools_port(proc, profile / "DevToolsActivePort")
            if port is None:
                failures.append(f"alive {proc.alive()}: {proc.tail()}")
                continue
            async with httpx.AsyncClient() as http:
                targets = (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
            page_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with websockets.connect(page_url, max_size=None) as ws:
                yield Page(ws)
            return
        finally:
            proc.stop()
            shutil.rmtree(profile, ignore_errors=True)
            proc.log.unlink(missing_ok=True)
    raise RuntimeError(f"chromium did not start in {LAUNCH_TRIES} tries:\n" + "\n---\n".join(failures))


async def _devtools_port(proc: Proc, port_file: Path) -> int | None:
    """The DevTools port chromium writes once it listens; None if it exits or is silent for LAUNCH_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LAUNCH_TIMEOUT_S
    while loop.time() < deadline and proc.alive():
        if port_file.exists() and (text := port_file.read_text().split()):  # noqa: ASYNC240
            return int(text[0])
        await asyncio.sleep(0.1)
    return None
