"""The null engine through a crash: a null scheduler killed mid-stream, its request resumed
by another, and the client's text is the no-fault text (the null engine's tokens are a
function of prompt and position, so a resume elsewhere continues them exactly); the
invariants hold after it. What bench/fabric.py measures is the real recovery path."""

from __future__ import annotations

import uuid

import pytest

from tests.support.fleet import (
    Fleet,
    Tap,
    assert_invariants,
    completion,
    finishes,
    no_fault_text,
    stream_until,
    text_of,
)

pytestmark = [pytest.mark.faults, pytest.mark.model]

PROMPT = "The history of the printing press begins"
NUM_TOKENS = 40
NULL = {"REDSERVE_SCHEDULER__ENGINE": "null", "REDSERVE_SCHEDULER__NULL_STEP_MS": "25"}


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Fleet:
    fleet.start("detok", "detokenizer")
    fleet.start("api", "api")
    for name in ("null-a", "null-b"):
        fleet.start(name, "scheduler", env=NULL)
    return fleet


def test_a_killed_null_schedulers_stream_resumes_on_another_with_the_same_text(
    stack: Fleet, tap: Tap
) -> None:
    body = completion(PROMPT, NUM_TOKENS)
    reference = no_fault_text(stack.url(), body)
    rid = f"null-fault-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
    owner = stack.worker_of(rid)
    stack.kill(owner)  # kill -9
    events += list(stream)

    assert text_of(events) == reference
    assert finishes(events) == ["length"]
    state = stack.redis().hgetall(stack.keys.state(rid))
    assert state["status"] == "finished" and state["epoch"] == "2" and state["worker"] != owner
    assert_invariants(stack, tap)
