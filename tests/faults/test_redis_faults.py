"""Redis restarting, away, full, and cutting slow subscribers off, on real processes: no
process exits, clients get a clear answer fast, and what was running finishes exactly."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
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

PROMPT = "A short guide to growing tomatoes at home:"
NUM_TOKENS = 40
TIERS = {"sched": "scheduler", "detok": "detokenizer", "api": "api"}


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Fleet:
    for name, tier in TIERS.items():
        fleet.start(name, tier, wait=False)
    for name, tier in TIERS.items():
        fleet.wait_ready(name, tier)
    return fleet


@pytest.fixture(scope="module")
def reference(stack: Fleet) -> str:
    return no_fault_text(stack.url(), completion(PROMPT, NUM_TOKENS))


def _open_stream(stack: Fleet, num_texts: int) -> tuple[str, Iterator[dict[str, Any]], list[Any]]:
    rid = f"redis-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), completion(PROMPT, NUM_TOKENS, rid=rid), num_texts)
    return rid, stream, events


def _serves_again(stack: Fleet, within_s: float) -> float:
    """Seconds until a fresh request succeeds again (fails the test after `within_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            resp = httpx.post(stack.url() + "/v1/completions", json=completion("Hi", 4), timeout=10)
            if resp.status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not serving {within_s}s after Redis came back\n{stack.logs()}")


def test_a_redis_restart_mid_stream_is_ridden_out(stack: Fleet, reference: str, tap: Tap) -> None:
    rid, stream, events = _open_stream(stack, 5)
    stack.server.kill()  # kill -9; the AOF (fsync every second) keeps the data
    time.sleep(1)
    stack.server.start()
    events += list(stream)

    assert all(stack.alive().values()), stack.logs()
    assert finishes(events) == ["length"], events[-1]
    assert text_of(events) == reference
    assert _serves_again(stack, 30) < 30
    assert_invariants(stack, tap)


def test_while_redis_is_away_new_requests_get_a_fast_503_and_nothing_exits(
    stack: Fleet,
) -> None:
    stack.server.kill()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        resp = httpx.post(stack.url() + "/v1/completions", json=completion("Hi", 4), timeout=10)
        took_s = time.monotonic() - started
        health = httpx.get(stack.url() + "/health", timeout=5)
    finally:
        time.sleep(3)  # long enough for every tier to notice and back off
        assert all(stack.alive().values()), stack.logs()
        stack.server.start()

    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"]
    assert took_s < 2, took_s
    assert health.status_code == 503
    assert _serves_again(stack, 30) < 30


def test_a_full_redis_answers_503_with_the_reason(stack: Fleet) -> None:
    r = stack.redis()
    r.config_set("maxmemory", "1")
    try:
        resp = httpx.post(stack.url() + "/v1/completions", json=completion("Hi", 4), timeout=10)
    finally:
        r.config_set("maxmemory", "0")
    assert resp.status_code == 503, resp.text
    assert "memory" in resp.json()["error"]["message"].lower()
    assert all(stack.alive().values())
    assert _serves_again(stack, 30) < 30


def test_subscribers_cut_off_by_redis_lose_no_token(stack: Fleet, reference: str, tap: Tap) -> None:
    """What `client-output-buffer-limit pubsub` does to a slow subscriber (Redis closes its
    connection; loopback socket buffers are too big to make it happen in a test), done to
    every subscriber — api, detokenizer, scheduler control — three times mid-stream."""
    r = stack.redis()
    rid, stream, events = _open_stream(stack, 3)
    cut = 0
    for _ in range(3):
        cut += int(r.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
        time.sleep(0.3)
    events += list(stream)

    assert cut >= 3 * 2  # the api's and the detokenizer's subscriptions at least, each time
    assert text_of(events) == reference
    assert finishes(events) == ["length"]
    assert all(stack.alive().values())
    assert_invariants(stack, tap)


def test_a_frozen_subscriber_loses_no_token(stack: Fleet, reference: str, tap: Tap) -> None:
    """A detokenizer that stops reading for a while (SIGSTOP) catches up by seq."""
    rid, stream, events = _open_stream(stack, 3)
    stack.signal("detok", signal.SIGSTOP)
    time.sleep(2)
    stack.signal("detok", signal.SIGCONT)
    events += list(stream)
    assert text_of(events) == reference
    assert_invariants(stack, tap)
