"""Crash recovery on a real 3-node Redis Cluster (its own, started by this module): two null
schedulers, two detokenizers and two api replicas as processes, `--redis-cluster
--stream-shards 6`. kill -9 of the scheduler, of the detokenizer that serves a stream, or of
the api replica that streams it: the client's text equals the no-fault text (a null
scheduler's tokens are a function of prompt and position, so a resume continues them), and
the fleet's invariants hold after each."""

from __future__ import annotations

import json
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
NULL = {"REDSERVE_SCHEDULER__ENGINE": "null", "REDSERVE_SCHEDULER__NULL_STEP_MS": "25"}


@pytest.fixture(scope="module")
def stack(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cluster = LocalCluster()
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
        for name in ("detok-a", "detok-b"):
            fleet.start(name, "detokenizer")
        for name in ("api", "api-b"):
            fleet.start(name, "api")
        for name in ("null-a", "null-b"):
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
    stack.start(holder, "detokenizer")


def test_a_killed_api_replica_s_stream_is_reattached_on_the_other(stack: Fleet) -> None:
    body = completion(PROMPT + " once more", NUM_TOKENS)
    reference = no_fault_text(stack.url("api-b"), body)
    rid = f"api-{uuid.uuid4().hex[:8]}"
    stream, events = stream_until(stack.url(), {**body, "rid": rid}, 5)
    seen = len(events)
    stack.kill("api")
    stream_rid_events = _reattach(stack.url("api-b"), rid, seen - 1)

    assert text_of(events + stream_rid_events) == reference
    assert finishes(stream_rid_events) == ["length"]
    state = stack.redis().hgetall(stack.keys.state(rid))
    assert state["status"] == "finished" and state["api_id"] == "api-b"
    assert_invariants(stack)
    stack.start("api", "api")


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
