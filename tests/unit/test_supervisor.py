"""`redserve up`'s stop: the tiers get SIGTERM one after another, schedulers first (they drain
while the api and the detokenizer still carry their output), then the api, then the
detokenizer; one that does not stop in its time is killed."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

from redserve.supervisor import STOP_ORDER, stop_tiers


class FakeProc:
    def __init__(self, name: str, log: list[str], stops: bool = True) -> None:
        self.name, self.log, self.stops = name, log, stops
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.log.append(f"{signal.Signals(sig).name} {self.name}")
        if self.stops:
            self.returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.log.append(f"waited {self.name} {timeout}")
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        return self.returncode

    def kill(self) -> None:
        self.log.append(f"SIGKILL {self.name}")
        self.returncode = -9


def test_tiers_stop_one_by_one_in_order() -> None:
    log: list[str] = []
    tiers = ("api", "detokenizer", "jobs", "scheduler")
    procs: dict[str, Any] = {t: FakeProc(t, log) for t in tiers}
    stop_tiers(procs)
    assert STOP_ORDER == ("jobs", "scheduler", "api", "detokenizer")
    assert log == ["SIGTERM jobs", "SIGTERM scheduler", "SIGTERM api", "SIGTERM detokenizer"]


def test_a_tier_that_does_not_stop_in_its_time_is_killed() -> None:
    log: list[str] = []
    procs: dict[str, Any] = {"scheduler": FakeProc("scheduler", log, stops=False)}
    stop_tiers(procs, timeout_s=1, drain_s=5)
    assert log == ["SIGTERM scheduler", "waited scheduler 6", "SIGKILL scheduler"]
