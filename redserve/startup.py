"""What `redserve up` says while the fleet starts: a line each time a scheduler's state or
loading progress changes (its beat: "loading model weights ...", kernel timings, compiles),
until the api's /health answers 200 (a scheduler is ready), then when it is up."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Callable

from shared import heartbeat
from shared.config import Settings
from shared.heartbeat import SchedulerBeat
from shared.redis_conn import REDIS_FAILURES, connect

POLL_S = 0.5


class StartupReport:
    """The lines to print for the schedulers' latest beats: only what changed."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.shown: dict[str, str] = {}

    def lines(self, beats: dict[str, SchedulerBeat], now: float) -> list[str]:
        out = []
        for worker_id, beat in sorted(beats.items()):
            text = f"{beat.state}: {beat.progress}" if beat.progress else beat.state
            if self.shown.get(worker_id) != text:
                self.shown[worker_id] = text
                out.append(f"scheduler {worker_id} {text} ({now - self.started:.0f} s)")
        return out


async def wait_ready(
    settings: Settings, running: Callable[[], bool], say: Callable[[str], None]
) -> bool:
    """Poll until the api's /health is 200 (True) or `running()` turns False (a tier exited),
    `say`ing each change of a scheduler's state."""
    url = f"http://{settings.api.host}:{settings.api.port}/health"
    r, keys = connect(settings.redis_url, settings.redis_cluster), settings.redis_keys()
    report = StartupReport(time.monotonic())
    try:
        while running():
            with contextlib.suppress(*REDIS_FAILURES):
                beats = await heartbeat.live_scheduler_beats(r, keys)
                for line in report.lines(beats, time.monotonic()):
                    say(line)
            if await asyncio.to_thread(_healthy, url):
                return True
            await asyncio.sleep(POLL_S)
        return False
    finally:
        await r.aclose()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
