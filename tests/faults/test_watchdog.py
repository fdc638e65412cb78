"""The scheduler watchdog on real processes: a scheduler whose model step hangs (the
tests.support.stalling_scheduler entry point: the real scheduler, its step N + 1 never returns)
dumps every thread's stack and exits non-zero; a healthy scheduler then reclaims the request it
held, which finishes with the no-fault text and exactly one finish."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import time
import uuid

import pytest

from tests.support.fleet import (
    Fleet,
    Tap,
    assert_invariants,
    completion,
    finishes,
    no_fault_text,
    stream_events,
    text_of,
)
from workers.scheduler.watchdog import WATCHDOG_EXIT_CODE

pytestmark = [pytest.mark.faults, pytest.mark.model]

PROMPT = "The history of the printing press begins"
NUM_TOKENS = 24
STALL_AFTER = 4  # e.g. the request's prefill and 3 decode steps go through
WATCHDOG_S = 6.0
# Reclaim soon after the stalled owner's heartbeat (TTL 10 s) is gone.
TIMINGS = {
    "REDSERVE_SCHEDULER__WATCHDOG_S": str(WATCHDOG_S),
    "REDSERVE_SCHEDULER__RECLAIM_MIN_IDLE_S": "10.5",
    "REDSERVE_SCHEDULER__RECLAIM_EVERY_S": "0.5",
}
STALLING = ["tests.support.stalling_scheduler", "--stall-after", str(STALL_AFTER)]


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Fleet:
    """An api, a detokenizer and the stalling scheduler alone (so the request lands on it)."""
    fleet.start("detok", "detokenizer")
    fleet.start("api", "api")
    fleet.start("sched-stall", "scheduler", env=TIMINGS, module=STALLING)
    return fleet


def test_a_hung_scheduler_dumps_its_stacks_exits_and_its_request_finishes_elsewhere(
    stack: Fleet, tap: Tap
) -> None:
    rid = f"wd-{uuid.uuid4().hex[:8]}"
    body = completion(PROMPT, NUM_TOKENS, rid=rid)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(lambda: list(stream_events(stack.url(), body)))
        _wait_for_worker(stack, rid)
        assert stack.worker_of(rid) == "sched-stall"
        stack.start("sched-ok", "scheduler", wait=False, env=TIMINGS)  # loads meanwhile

        stalled = stack.procs["sched-stall"]
        try:
            code = stalled.wait(WATCHDOG_S + 60)  # its timeout, and room for a slow box
        except subprocess.TimeoutExpired:
            pytest.fail(f"the hung scheduler is still up\n{stack.logs()}")
        log = (stack.log_dir / "sched-stall.log").read_text(errors="replace")
        assert code == WATCHDOG_EXIT_CODE, log[-3000:]
        assert re.search(r"step \d+ hangs for good", log), log[-3000:]
        assert "watchdog: no progress for" in log
        assert "Thread 0x" in log and 'File "' in log  # faulthandler's dump of every thread
        assert "stalling_scheduler.py" in log  # with the hung frame
        del stack.procs["sched-stall"]
        events = streamed.result(timeout=300)  # reclaimed by sched-ok, resumed from rs:ids

    assert finishes(events) == ["length"]
    state = stack.redis().hgetall(stack.keys.state(rid))
    assert state["status"] == "finished" and state["worker"] == "sched-ok"
    assert text_of(events) == no_fault_text(stack.url(), completion(PROMPT, NUM_TOKENS))
    assert_invariants(stack, tap)
    assert stack.alive()["sched-ok"]  # a healthy loop, busy or idle, does not trip its own


def _wait_for_worker(stack: Fleet, rid: str, timeout_s: float = 60) -> None:
    """Until a scheduler took `rid` (its state hash names the worker)."""
    deadline = time.monotonic() + timeout_s
    while not stack.redis().hget(stack.keys.state(rid), "worker"):
        assert time.monotonic() < deadline, f"no scheduler took {rid}\n{stack.logs()}"
        time.sleep(0.05)
