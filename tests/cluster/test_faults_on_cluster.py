"""Crash recovery on a real 3-node Redis Cluster (its own, started by this module): two null
schedulers, two detokenizers and two api replicas as processes, `--redis-cluster
--stream-shards 6`. kill -9 of the scheduler, of the detokenizer that serves a stream, or of
the api replica that streams it; a scheduler frozen past the reclaim time that wakes up; a
scheduler's SIGTERM hand-over; a dead replica's stream that nobody re-attaches. The client's
text equals the no-fault text (a null scheduler's tokens are a function of prompt and
position, so a resume continues them), and the fleet's invariants hold after each."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from shared.config import SchedulerSettings, Settings
from shared.keys import shard_of
from tests.support.cluster import LocalCluster
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

pytestmark = [pytest.mark.redis, pytest.mark.faults, pytest.mark.model]

PROMPT = "The history of the printing press begins"
NUM_TOKENS = 40
TOKEN_SHARDS = 2
SCHEDULERS = ("null-a", "null-b")
DETOKENIZERS = ("detok-a", "detok-b")
# DRAIN_S is shorter than the rest of a request: SIGTERM hands it over instead of finishing it.
NULL = {"REDSERVE_SCHEDULER__ENGINE": "null", "REDSERVE_SCHEDULER__NULL_STEP_MS": "25",
        "REDSERVE_SCHEDULER__DRAIN_S": "0.3"}  # fmt: skip
# A node's restart, AOF replay and rejoin take seconds more on a loaded machine: the replicas
# wait 20 s, not 5, before they fail the requests of an unreachable Redis.
RIDE_OUT = {"REDSERVE_API__REDIS_OUTAGE_S": "20"}


@pytest.fixture(scope="module")
def stack(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cluster = LocalCluster(appendonly=True)  # a restarted node keeps its data, as in compose
    settings = Settings(
        redis_url=cluster.start(),
        redis_cluster=True,
        stream_shards=6,
        num_token_shards=TOKEN_SHARDS,
        key_prefix=f"cf{uuid.uuid4().hex[:6]}",
        model=model_path,
        scheduler=SchedulerSettings(kv_cache_tokens=4096),
    )
    fleet = Fleet(cluster, settings, tmp_path_factory.mktemp("cluster-fleet-logs"))
    try:
        for name in DETOKENIZERS:
            fleet.start(name, "detokenizer")
        for name in ("api", "api-b"):
            fleet.start(name, "api", env=RIDE_OUT)
        for name in SCHEDULERS:
            fleet.start(name, "scheduler", env=NULL)
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def tap(stack: Fleet) -> Iterator[Tap]:
    tap = Tap(stack)
    yield tap
    tap.close()


def test_a_killed_scheduler_s_stream_resumes_on_another_with_the_same_text(
    stack: Fleet, tap: Tap
) -> None:
    body = completion(PROMPT, NUM_TOKENS)
    reference = no_fault_text(stack.url(), body)
    rid = f"sched-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
    owner = stack.worker_of(rid)
    stack.kill(owner)
    events += list(stream)

    assert text_of(events) == reference
    assert finishes(events) == ["length"]
    state = stack.redis().hgetall(stack.keys.state(rid))
    assert state["status"] == "finished" and state["epoch"] == "2" and state["worker"] != owner
    assert_invariants(stack, tap)
    stack.start(owner, "scheduler", env=NULL)  # the next case has two again


def test_a_killed_detokenizer_s_shard_moves_and_the_text_is_whole(stack: Fleet, tap: Tap) -> None:
    body = completion(PROMPT + " again", NUM_TOKENS)
    reference = no_fault_text(stack.url(), body)
    rid = f"detok-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
    lease = stack.keys.shard_lease(shard_of(rid, TOKEN_SHARDS))
    holder = stack.redis().get(lease)
    assert isinstance(holder, str)
    stack.kill(holder)
    events += list(stream)

    assert text_of(events) == reference
    assert finishes(events) == ["length"]
    assert_invariants(stack, tap)
    restarted_at = time.time()
    stack.start(holder, "detokenizer")
    # Until a lease lapses and is rescued, the dead holder's shard reaches nobody (the api
    # refills its requests from the id log after a stall), and a rebalance moves one: the
    # next case needs each shard served by one detokenizer, for good.
    _wait_until_the_shards_are_balanced(stack, restarted_at)


def test_a_killed_api_replica_s_stream_is_reattached_on_the_other(stack: Fleet) -> None:
    body = completion(PROMPT + " once more", NUM_TOKENS)
    reference = no_fault_text(stack.url("api-b"), body)
    rid = f"api-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
    seen = len(events)
    assert not finishes(events), "the request ended before the kill"
    stack.kill("api")
    try:
        stream_rid_events = _reattach(stack.url("api-b"), rid, seen - 1)

        assert text_of(events + stream_rid_events) == reference, stack.logs()
        assert finishes(stream_rid_events) == ["length"], stack.logs()
        state = stack.redis().hgetall(stack.keys.state(rid))
        assert state["status"] == "finished" and state["api_id"] == "api-b"
        assert_invariants(stack)
    finally:
        stack.start("api", "api", env=RIDE_OUT)  # the next cases stream through it


def test_a_frozen_scheduler_that_wakes_up_publishes_nothing_for_the_request_it_lost(
    stack: Fleet, tap: Tap
) -> None:
    body = completion(PROMPT + " and spreads", NUM_TOKENS)
    reference = no_fault_text(stack.url(), body)
    rid = f"frozen-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
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


def test_sigterm_hands_a_scheduler_s_requests_over_at_once(stack: Fleet, tap: Tap) -> None:
    body = completion(PROMPT + " in Europe", NUM_TOKENS)
    reference = no_fault_text(stack.url(), body)
    rid = f"drain-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 3)
    owner = stack.worker_of(rid)
    stopped_at = time.monotonic()
    code = stack.stop(owner)
    events += list(stream)
    took_s = time.monotonic() - stopped_at

    assert code == 0
    assert text_of(events) == reference
    assert took_s < 10, took_s  # well before a dead owner's jobs become claimable (12 s)
    assert_invariants(stack, tap)
    stack.start(owner, "scheduler", env=NULL)


def test_a_dead_replica_s_stream_that_nobody_re_attaches_is_aborted(stack: Fleet) -> None:
    stack.start("api-reaper", "api", env={"REDSERVE_API__ORPHAN_GRACE_S": "2"})
    stack.start("api-victim", "api")
    rid = f"orphan-{uuid.uuid4().hex[:8]}"
    body = completion(PROMPT, 2000, rid=rid)  # 50 s of null steps: far longer than the wait
    _stream, _events = stream_until(stack.url("api-victim"), body, 3)
    stack.kill("api-victim")
    r = stack.redis()
    deadline = time.monotonic() + 90  # heartbeat TTL (10 s) + grace (2 s) + a reaper pass
    while r.hget(stack.keys.state(rid), "status") != "aborted" and time.monotonic() < deadline:
        time.sleep(0.5)

    assert r.hget(stack.keys.state(rid), "status") == "aborted"
    assert r.llen(stack.keys.ids(rid)) < 2000
    assert _nothing_running(stack), "a scheduler still runs the aborted request"
    assert stack.stop("api-reaper") == 0
    assert_invariants(stack)


def test_a_node_restart_mid_stream_is_ridden_out(stack: Fleet, tap: Tap) -> None:
    body = completion(PROMPT + " across the sea", NUM_TOKENS)
    reference = no_fault_text(stack.url(), body)
    rid = f"node-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
    cluster = stack.server
    assert isinstance(cluster, LocalCluster)
    port = stack.redis().get_node_from_key(stack.keys.state(rid)).port  # type: ignore[attr-defined]
    node = cluster.ports.index(int(port))
    cluster.kill(node)  # kill -9 of the master holding the request's keys
    time.sleep(1)  # the restart and its rejoin stay under the api's give-up time (RIDE_OUT)
    cluster.restart(node)
    events += list(stream)

    assert all(stack.alive().values()), stack.logs()
    assert finishes(events) == ["length"], events[-1]
    assert text_of(events) == reference
    assert _serves_again(stack, 30) < 30
    assert_invariants(stack, tap)


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
    raise AssertionError(f"not serving {within_s}s after the node came back\n{stack.logs()}")


def test_a_scheduler_with_another_stream_shard_count_exits_2_saying_why(stack: Fleet) -> None:
    stack.start("null-odd", "scheduler", wait=False, env={**NULL, "REDSERVE_STREAM_SHARDS": "3"})
    code = stack.procs["null-odd"].wait(timeout=120)
    log = (stack.log_dir / "null-odd.log").read_text()
    assert code == 2, log
    assert "this fleet runs 6 request stream shard(s)" in log and "Traceback" not in log
    del stack.procs["null-odd"]


def _nothing_running(stack: Fleet, timeout_s: float = 10) -> bool:
    """Whether every scheduler soon beats with nothing running."""
    r = stack.redis()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [r.hgetall(stack.keys.heartbeat("scheduler", name)) for name in SCHEDULERS]
        if all(b and b["num_running"] == "0" for b in beats):
            return True
        time.sleep(0.5)
    return False


def _wait_until_the_shards_are_balanced(
    stack: Fleet, since: float, timeout_s: float = 30.0
) -> None:
    """Until each detokenizer's beat, written after `since`, names one shard it serves
    (beats list what the last tick subscribed to)."""
    r, deadline = stack.redis(), time.monotonic() + timeout_s
    while True:
        served = []
        for name in DETOKENIZERS:
            beat = r.hgetall(stack.keys.heartbeat("detokenizer", name))
            if beat and float(beat["updated_at"]) > since:
                served.append(sorted(int(s) for s in beat["shards"].split(",") if s))
        if sorted(served) == [[shard] for shard in range(TOKEN_SHARDS)]:
            return
        assert time.monotonic() < deadline, f"shards served: {served}\n{stack.logs()}"
        time.sleep(0.2)


def _reattach(base_url: str, rid: str, last_event_id: int) -> list[dict[str, object]]:
    """The events after `last_event_id` of `rid`'s stream, re-attached at `base_url`."""
    headers = {"Last-Event-ID": str(last_event_id)}
    url = f"{base_url}/v1/requests/{rid}/stream"
    with httpx.stream("GET", url, headers=headers, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return [
            json.loads(line[len("data: ") :])
            for line in resp.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
