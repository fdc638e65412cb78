"""Schedulers dying, freezing, stopping and failing on real processes: the client's text is
the no-fault text, and the invariants hold after each case (tests/support/fleet.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from shared import request_stream
from shared.keys import SCHEDULER_GROUP
from shared.redis_conn import connect
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
SCHEDULERS = ("sched-a", "sched-b")
# Shorter than the rest of a request: SIGTERM hands it over instead of finishing it.
DRAIN = {"REDSERVE_SCHEDULER__DRAIN_S": "0.3"}


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Fleet:
    fleet.start("detok", "detokenizer")
    fleet.start("api", "api")
    for name in SCHEDULERS:
        fleet.start(name, "scheduler", wait=False, env=DRAIN)
    for name in SCHEDULERS:
        fleet.wait_ready(name, "scheduler")
    return fleet


@pytest.fixture(scope="module")
def reference(stack: Fleet) -> str:
    """The no-fault text of the request every case sends."""
    return no_fault_text(stack.url(), completion(PROMPT, NUM_TOKENS))


def _rid() -> str:
    return f"fault-{uuid.uuid4().hex[:8]}"


def _stream_until(
    stack: Fleet, rid: str, num_texts: int, **extra: Any
) -> tuple[Iterator[dict[str, Any]], list[dict[str, Any]]]:
    return stream_until(stack.url(), completion(PROMPT, NUM_TOKENS, rid=rid, **extra), num_texts)


def _restart_missing_schedulers(stack: Fleet) -> None:
    for name in SCHEDULERS:
        if name not in stack.procs:
            stack.start(name, "scheduler", env=DRAIN)


def test_a_killed_schedulers_stream_resumes_on_another_with_the_same_text(
    stack: Fleet, reference: str, tap: Tap
) -> None:
    rid = _rid()
    stream, events = _stream_until(stack, rid, 5)
    owner = stack.worker_of(rid)
    stack.kill(owner)  # kill -9
    events += list(stream)

    assert text_of(events) == reference
    assert finishes(events) == ["length"]
    state = stack.redis().hgetall(stack.keys.state(rid))
    assert state["status"] == "finished" and state["epoch"] == "2" and state["worker"] != owner
    assert stack.redis().llen(stack.keys.ids(rid)) == NUM_TOKENS
    assert_invariants(stack, tap)
    _restart_missing_schedulers(stack)


def test_a_seeded_sampled_stream_resumes_at_the_same_generator_position(
    stack: Fleet, tap: Tap
) -> None:
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    no_fault = no_fault_text(stack.url(), completion(PROMPT, NUM_TOKENS, **seeded))
    rid = _rid()
    stream, events = _stream_until(stack, rid, 5, **seeded)
    stack.kill(stack.worker_of(rid))
    events += list(stream)

    assert text_of(events) == no_fault  # sampled, yet the same: draws keyed by (seed, index)
    assert stack.redis().hget(stack.keys.state(rid), "epoch") == "2"
    assert_invariants(stack, tap)
    _restart_missing_schedulers(stack)


def test_a_constrained_stream_resumes_with_its_grammar_where_it_stood(
    stack: Fleet, tap: Tap
) -> None:
    schema = {"type": "object", "required": ["items"], "properties": {
        "items": {"type": "array", "minItems": 4, "items": {"type": "string", "maxLength": 12}}}}
    # Greedy: a sampled draw from the flat distributions a schema can force (free strings)
    # may flip on the 1e-5 logit noise between a resume's prefill and the decode it replaces.
    body = {"ignore_eos": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": schema}}}
    no_fault = no_fault_text(stack.url(), completion(PROMPT, NUM_TOKENS, **body))
    rid = _rid()
    stream, events = _stream_until(stack, rid, 5, **body)
    stack.kill(stack.worker_of(rid))
    events += list(stream)

    # The new owner rebuilt the matcher from the ids so far: the same valid JSON.
    assert text_of(events) == no_fault and no_fault.startswith('{"items": [')
    assert stack.redis().hget(stack.keys.state(rid), "epoch") == "2"
    assert_invariants(stack, tap)
    _restart_missing_schedulers(stack)


def test_with_no_scheduler_alive_jobs_wait_for_the_next_one(
    stack: Fleet, reference: str, tap: Tap
) -> None:
    rid = _rid()
    stream, events = _stream_until(stack, rid, 3)
    owner = stack.worker_of(rid)
    other = next(name for name in SCHEDULERS if name != owner)
    assert stack.stop(other) == 0  # idle: exits at once
    stack.kill(owner)
    time.sleep(1)
    stack.start(owner, "scheduler", wait=False, env=DRAIN)  # a new process, the same name
    events += list(stream)

    assert text_of(events) == reference
    assert_invariants(stack, tap)
    _restart_missing_schedulers(stack)


def test_a_frozen_scheduler_that_wakes_up_publishes_nothing_for_the_request_it_lost(
    stack: Fleet, reference: str, tap: Tap
) -> None:
    rid = _rid()
    stream, events = _stream_until(stack, rid, 5)
    owner = stack.worker_of(rid)
    stack.signal(owner, signal.SIGSTOP)  # past the reclaim time: the other takes it over
    owner_woke = False
    try:
        for event in stream:
            events.append(event)
            if not owner_woke and stack.worker_of(rid) != owner:
                stack.signal(owner, signal.SIGCONT)  # wakes up with the request still in hand
                owner_woke = True
    finally:
        stack.signal(owner, signal.SIGCONT)

    assert owner_woke
    assert text_of(events) == reference
    assert finishes(events) == ["length"]
    time.sleep(1)  # the woken owner's next steps are refused
    assert stack.alive()[owner], "the woken scheduler must not crash"
    assert_invariants(stack, tap)
    assert {e.epoch for e in tap.of(rid)} <= {1, 2}


def test_sigterm_drains_then_hands_the_rest_over_at_once(
    stack: Fleet, reference: str, tap: Tap
) -> None:
    rid = _rid()
    stream, events = _stream_until(stack, rid, 3)
    owner = stack.worker_of(rid)
    stopped_at = time.monotonic()
    code = stack.stop(owner)  # its drain (DRAIN_S) is too short for the rest of the request
    events += list(stream)
    took_s = time.monotonic() - stopped_at

    assert code == 0
    assert text_of(events) == reference
    # At once: well before a dead owner's jobs become claimable (reclaim_min_idle_s, 12 s).
    assert took_s < 10, took_s
    assert_invariants(stack, tap)
    _restart_missing_schedulers(stack)


def test_a_dead_replicas_stream_that_nobody_re_attaches_is_aborted_and_its_kv_freed(
    stack: Fleet,
) -> None:
    stack.start("api-reaper", "api", env={"REDSERVE_API__ORPHAN_GRACE_S": "2"})
    stack.start("api-victim", "api")
    rid = _rid()
    body = completion(PROMPT, 1000, rid=rid)  # far longer than the test waits
    _stream, _events = stream_until(stack.url("api-victim"), body, 3)
    stack.kill("api-victim")
    r = stack.redis()
    deadline = time.monotonic() + 90  # heartbeat TTL (10 s) + grace (2 s) + a reaper pass
    while r.hget(stack.keys.state(rid), "status") != "aborted" and time.monotonic() < deadline:
        time.sleep(0.5)
    info = httpx.get(stack.url() + f"/v1/requests/{rid}", timeout=10).json()
    assert info["status"] == "aborted", info
    assert r.llen(stack.keys.ids(rid)) < 1000
    assert _kv_freed(stack), "a scheduler still runs the aborted request"
    assert stack.stop("api-reaper") == 0
    assert_invariants(stack)


def test_a_job_delivered_too_often_is_dead_lettered_and_its_client_told(stack: Fleet) -> None:
    r = stack.redis()
    keys = stack.keys
    for name in SCHEDULERS:  # hold the schedulers so that a ghost gets the job first
        stack.signal(name, signal.SIGSTOP)
    time.sleep(0.3)  # their blocking reads time out (idle_block_ms)
    rid = _rid()
    try:
        with httpx.Client(timeout=120) as client:
            pending = client.build_request(
                "POST", stack.url() + "/v1/completions", json=completion(PROMPT, 8, rid=rid)
            )
            resp_future = _send_in_thread(client, pending)
            entry_id = _deliver_to_ghost(stack)
            # As if three schedulers had died on it: the next delivery is one too many.
            r.xclaim(keys.request_stream, SCHEDULER_GROUP, "ghost", 0, [entry_id], idle=60_000,
                     retrycount=3, justid=True)  # fmt: skip
            for name in SCHEDULERS:
                stack.signal(name, signal.SIGCONT)
            resp = resp_future()
    finally:
        for name in SCHEDULERS:
            stack.signal(name, signal.SIGCONT)

    assert resp.status_code == 500, resp.text
    assert "4 deliveries" in resp.json()["error"]["message"]
    letters = [info for _id, info in _dead_letters(stack) if info["rid"] == rid]
    assert len(letters) == 1 and letters[0]["deliveries"] == "4"
    assert r.hget(keys.state(rid), "status") == "aborted"
    assert_invariants(stack)

    # An operator looks, and requeues it: it runs again, its result readable by rid.
    listed = _dlq(stack, "list")
    assert rid in listed and "deliveries=4" in listed
    assert f"requeued {rid}" in _dlq(stack, "retry", rid)
    deadline = time.monotonic() + 60
    while r.hget(keys.state(rid), "status") != "finished" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.hget(keys.state(rid), "status") == "finished"
    assert r.llen(keys.ids(rid)) == 8
    assert rid not in _dlq(stack, "list")
    assert_invariants(stack)


def _dlq(stack: Fleet, *args: str) -> str:
    env = {**os.environ, "REDSERVE_REDIS_URL": stack.server.url,
           "REDSERVE_KEY_PREFIX": stack.settings.key_prefix}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "redserve.cli", "dlq", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout


def _kv_freed(stack: Fleet, timeout_s: float = 10) -> bool:
    """Whether every scheduler soon beats with nothing running and every KV block free."""
    r = stack.redis()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [r.hgetall(stack.keys.heartbeat("scheduler", name)) for name in SCHEDULERS]
        if all(b and b["num_running"] == "0" and b["num_free_blocks"] == b["num_total_blocks"]
               for b in beats):  # fmt: skip
            return True
        time.sleep(0.5)
    return False


def _deliver_to_ghost(stack: Fleet) -> bytes:
    """The newest job, pending under "ghost" (read as it, or moved from whoever got it)."""
    r = redis.Redis.from_url(stack.server.url)  # bytes: the job is msgpack
    stream = stack.keys.request_stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = r.xreadgroup(SCHEDULER_GROUP, "ghost", {stream: ">"}, count=1)
        if got:
            return bytes(got[0][1][0][0])
        pending = r.xpending_range(stream, SCHEDULER_GROUP, "-", "+", 10)
        if pending:  # a scheduler read it in the moment before it froze
            entry_id = bytes(pending[-1]["message_id"])
            r.xclaim(stream, SCHEDULER_GROUP, "ghost", 0, [entry_id], justid=True)
            return entry_id
        time.sleep(0.05)
    raise AssertionError("the job never reached the stream")


def _send_in_thread(client: httpx.Client, request: httpx.Request) -> Any:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(client.send, request)
    return lambda: future.result(timeout=120)


def _dead_letters(stack: Fleet) -> list[tuple[bytes, dict[str, str]]]:
    async def read() -> list[tuple[bytes, dict[str, str]]]:
        r = connect(stack.server.url)
        try:
            return await request_stream.dead_letters(r, stack.keys)
        finally:
            await r.aclose()

    return asyncio.run(read())
