"""The real stack as the e2e tests hold it: the tiers' processes, their settings and logs,
and waiting until it serves (api /health and the scheduler's heartbeat)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from redserve.supervisor import start_tiers, stop_tiers
from shared.config import Settings
from shared.keys import Keys
from tests.support.cluster import sync_client

# A cold start times its kernels before it serves (engine/kernel_choices.py): about 50 s on
# 2 idle vCPUs, four times that beside the other test worker's model tests. Starts after it
# take the stored record (or wait for the one being timed), in seconds.
STARTUP_TIMEOUT_S = 420


@dataclass
class Stack:
    settings: Settings
    procs: dict[str, subprocess.Popen[bytes]]
    log_dir: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.api.port}"

    @property
    def keys(self) -> Keys:
        return self.settings.redis_keys()

    def redis(self) -> redis.Redis:
        return sync_client(self.settings, decode_responses=True)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


def wait_ready(stack: Stack) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    r = stack.redis()
    beat = stack.keys.heartbeat("scheduler", stack.settings.scheduler.worker_id)
    while time.monotonic() < deadline:
        dead = {t: p.returncode for t, p in stack.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"tiers exited early: {dead}\n{stack.logs()}")
        try:
            with urllib.request.urlopen(stack.base_url + "/health", timeout=1) as resp:
                if resp.status == 200 and r.exists(beat):
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"stack not ready in {STARTUP_TIMEOUT_S}s\n{stack.logs()}")


@contextlib.contextmanager
def running_stack(settings: Settings, log_dir: Path) -> Iterator[Stack]:
    """Every tier as its own process until the block ends; then each must exit cleanly."""
    stack = Stack(settings, start_tiers(settings, log_dir), log_dir)
    try:
        wait_ready(stack)
        yield stack
    finally:
        stop_tiers(stack.procs)
    codes = {t: p.returncode for t, p in stack.procs.items()}
    assert all(c == 0 for c in codes.values()), f"unclean exit {codes}\n{stack.logs()}"
