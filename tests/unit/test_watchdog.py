"""The scheduler's watchdog: it fires once the loop's progress stamp has not moved for its
timeout (counted from when watching began, not from before the model loaded), not while the
stamp moves, and not for a process that was stopped; the default stall handler dumps every
thread's stack and exits non-zero."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shared.config import SchedulerSettings, Settings
from workers.scheduler.watchdog import (
    OVERSLEEP_S,
    WATCHDOG_EXIT_CODE,
    Watchdog,
    start_watchdog,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Stamped:
    last_progress = 0.0


def _watchdog(clock: Clock, stamp: list[float], timeout_s: float = 10.0) -> Watchdog:
    return Watchdog(timeout_s, lambda: stamp[0], on_stall=lambda s: None, clock=clock)


def _walk(dog: Watchdog, clock: Clock, until: float) -> bool:
    """Check at every period up to `until` (as the thread would); whether any check fired."""
    fired = False
    while clock.now < until:
        clock.now = min(until, clock.now + dog.check_every_s)
        fired = dog.check(clock.now) or fired
    return fired


def test_it_fires_once_the_stamp_stood_still_for_the_timeout() -> None:
    clock, stamp = Clock(), [1000.0]
    dog = _watchdog(clock, stamp)
    assert not _walk(dog, clock, 1009.5)
    stamp[0] = 1009.5  # one more iteration
    assert not _walk(dog, clock, 1019.0)
    assert _walk(dog, clock, 1019.5)
    assert dog.stalled_for(clock.now) == pytest.approx(10.0)


def test_time_before_watching_began_does_not_count() -> None:
    """The model loads before the loop starts: a stamp older than the start is no stall."""
    clock, stamp = Clock(), [0.0]  # never stamped, or stamped long ago
    dog = _watchdog(clock, stamp)
    assert not _walk(dog, clock, 1009.0)
    assert _walk(dog, clock, 1010.0)


def test_a_process_that_was_stopped_gets_a_fresh_timeout() -> None:
    """SIGSTOP (or a suspended VM) stops the loop and the watchdog alike: no stall."""
    clock, stamp = Clock(), [1000.0]
    dog = _watchdog(clock, stamp)
    _walk(dog, clock, 1005.0)
    clock.now += 60 + OVERSLEEP_S  # the watchdog's own sleep overran by far
    assert not dog.check(clock.now)
    assert not _walk(dog, clock, clock.now + 9.0)
    assert _walk(dog, clock, clock.now + 1.0)


def test_the_thread_calls_on_stall_once_when_the_stamp_stops() -> None:
    stamp = [time.monotonic()]
    stalls: list[float] = []
    fired = threading.Event()

    def on_stall(seconds: float) -> None:
        stalls.append(seconds)
        fired.set()

    dog = Watchdog(0.4, lambda: stamp[0], on_stall=on_stall)
    dog.start()
    try:
        assert fired.wait(10)
        time.sleep(3 * dog.check_every_s)
    finally:
        dog.stop()
    assert len(stalls) == 1 and stalls[0] >= 0.4


def test_a_stopped_watchdog_never_fires() -> None:
    stalls: list[float] = []
    dog = Watchdog(0.2, lambda: 0.0, on_stall=stalls.append)
    dog.start()
    dog.stop()
    time.sleep(0.5)
    assert not stalls


def test_start_watchdog_watches_the_loops_stamp_unless_the_setting_is_zero() -> None:
    loop = Stamped()
    assert start_watchdog(loop, Settings(scheduler=SchedulerSettings(watchdog_s=0))) is None
    with pytest.raises(ValueError):
        Watchdog(0, lambda: 0.0)
    dog = start_watchdog(loop, Settings(scheduler=SchedulerSettings(watchdog_s=50)))
    assert dog is not None and dog.timeout_s == 50
    try:
        loop.last_progress = time.monotonic() + 5
        assert dog.stalled_for(time.monotonic()) < 0  # it reads the loop's stamp
    finally:
        dog.stop()


def test_the_default_handler_dumps_every_threads_stack_and_exits_non_zero() -> None:
    script = textwrap.dedent(
        """
        import logging, threading, time
        from workers.scheduler.watchdog import Watchdog

        logging.basicConfig(level="INFO")
        def hung_worker():
            time.sleep(60)
        threading.Thread(target=hung_worker, name="hung", daemon=True).start()
        Watchdog(0.3, lambda: 0.0).start()
        time.sleep(60)  # the hung main thread: it never stamps
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr
    assert "watchdog: no progress for" in proc.stderr
    assert "Current thread" in proc.stderr  # the watchdog's own, then every other one
    assert proc.stderr.count("Thread 0x") >= 2  # the main thread and the hung worker
    assert "in hung_worker" in proc.stderr and 'File "<string>"' in proc.stderr
