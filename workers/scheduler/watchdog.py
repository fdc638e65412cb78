"""The scheduler's hard watchdog (SGLang's --watchdog-timeout): a daemon thread that watches
the loop's progress stamp and, when it has not moved for `watchdog_s`, dumps every thread's
stack to stderr and exits the process non-zero. Its unacked jobs are then reclaimed by another
scheduler, and a supervisor restarts it.

A thread, not a task: a hung model step (or any blocking call) holds the asyncio loop, so
nothing on that loop could notice. The exit is os._exit: a hung thread must not keep the
process up, and no cleanup that might itself hang runs.

The loop stamps `last_progress` (time.monotonic()) at every iteration. An idle loop still
iterates (it blocks at most idle_block_ms on the job stream), a Redis outage is waited out
with sleeps between iterations, and the model loads before the watchdog starts: none of these
stalls the stamp. A process that was stopped (SIGSTOP, a suspended VM) is not stalled either:
when the watchdog's own sleep overran by far, it gives the loop a fresh timeout.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from shared.config import Settings

logger = logging.getLogger(__name__)

# sysexits' EX_SOFTWARE: an internal error, distinct from a crash's 1 and a signal's 128 + n.
WATCHDOG_EXIT_CODE = 70
# How often the thread looks, at most: a stall is seen within timeout + this.
MAX_CHECK_EVERY_S = 1.0
# The watchdog's sleep overran by this much more than its period: the whole process was not
# running (stopped or suspended), so the loop could not have progressed either.
OVERSLEEP_S = 2.0

Clock = Callable[[], float]


class Progressing(Protocol):
    """What the watchdog reads of the scheduler loop: its progress stamp (monotonic s)."""

    last_progress: float


class Watchdog:
    """Calls `on_stall(seconds without progress)` once when `progress()` (a monotonic time)
    has not moved for `timeout_s`; the default dumps all stacks and exits the process."""

    def __init__(
        self,
        timeout_s: float,
        progress: Callable[[], float],
        on_stall: Callable[[float], None] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("a watchdog needs a positive timeout")
        self.timeout_s = timeout_s
        self.progress = progress
        self.on_stall = on_stall or dump_stacks_and_exit
        self.clock = clock
        self.check_every_s = min(MAX_CHECK_EVERY_S, timeout_s / 4)
        self._since = clock()  # progress before this does not count (the model was loading)
        self._last_check = self._since
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._since = self._last_check = self.clock()
        self._thread = threading.Thread(target=self._run, name="scheduler-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the loop has returned: nothing more is expected of it)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.check_every_s + 1)
        self._thread = None

    def stalled_for(self, now: float) -> float:
        """Seconds since the last progress (or since watching began, if that is later)."""
        return now - max(self.progress(), self._since)

    def check(self, now: float) -> bool:
        """One look at the stamp; True when the loop has stalled for timeout_s."""
        if now - self._last_check > self.check_every_s + OVERSLEEP_S:
            logger.warning(
                "watchdog: this process did not run for %.1fs (stopped?); timeout restarts",
                now - self._last_check,
            )
            self._since = now
        self._last_check = now
        return self.stalled_for(now) >= self.timeout_s

    def _run(self) -> None:
        while not self._stopped.wait(self.check_every_s):
            now = self.clock()
            if self.check(now):
                self.on_stall(self.stalled_for(now))
                return


def dump_stacks_and_exit(stalled_s: float) -> None:
    """A log line, every thread's stack on stderr, then exit WATCHDOG_EXIT_CODE at once."""
    logger.critical(
        "watchdog: no progress for %.1fs; dumping all thread stacks and exiting (code %d)",
        stalled_s,
        WATCHDOG_EXIT_CODE,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT_CODE)


def start_watchdog(loop: Progressing, settings: Settings) -> Watchdog | None:
    """Watch `loop`'s progress stamp (None when scheduler.watchdog_s is 0: off). Call once the
    model is loaded, just before the loop runs; stop() it when the loop has returned."""
    timeout_s = settings.scheduler.watchdog_s
    if timeout_s <= 0:
        return None
    watchdog = Watchdog(timeout_s, lambda: loop.last_progress)
    watchdog.start()
    logger.info("watchdog: exits after %.0fs without progress", timeout_s)
    return watchdog
