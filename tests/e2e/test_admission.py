"""Admission on real processes (a real redis-server; api, scheduler and detokenizer as OS
processes on the real model): a burst over MAX_QUEUED_REQUESTS sheds with 503 + Retry-After
and never a 500, and every request accepted finishes; an API key's rate limit and in-flight
cap hold across two api replicas that share the bucket through Redis."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared import limits
from shared.config import SchedulerSettings, Settings
from shared.embedded_redis import EmbeddedRedis
from tests.support.fleet import Fleet, completion

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_QUEUED = 2
BURST = 12
KEY, OTHER_KEY = "e2e-key", "e2e-other-key"
# The limited replicas: 2 requests at once per key, then one per 20 s; 1 in flight per key.
LIMITS = {
    "REDSERVE_API__API_KEYS": f'["{KEY}", "{OTHER_KEY}"]',
    "REDSERVE_API__RATE_LIMIT_RPS": "0.05",
    "REDSERVE_API__RATE_LIMIT_BURST": "2",
    "REDSERVE_API__MAX_CONCURRENT_REQUESTS_PER_KEY": "1",
}


@pytest.fixture(scope="module")
def fleet(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One scheduler of 2 sequences at a time; "api" bounds the queue, "lim1" and "lim2"
    limit each API key."""
    server = EmbeddedRedis()
    settings = Settings(
        redis_url=server.start(),
        key_prefix=f"adm{uuid.uuid4().hex[:6]}",
        model=model_path,
        scheduler=SchedulerSettings(
            dtype="float32", quantization="none", kv_cache_tokens=2048, num_threads=1,
            max_num_seqs=2,
        ),  # fmt: skip
    )
    fleet = Fleet(server, settings, tmp_path_factory.mktemp("admission-logs"))
    try:
        fleet.start("sched", "scheduler")
        fleet.start("detok", "detokenizer")
        fleet.start("api", "api", env={"REDSERVE_API__MAX_QUEUED_REQUESTS": str(MAX_QUEUED)})
        fleet.start("lim1", "api", env=LIMITS)
        fleet.start("lim2", "api", env=LIMITS)
        yield fleet
    finally:
        fleet.close()


def post(base_url: str, body: dict[str, object], key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=300)


def test_a_burst_over_the_queue_bound_sheds_with_503_and_loses_nothing(fleet: Fleet) -> None:
    url = fleet.url("api")
    bodies = [completion(f"Count to {i}:", 16, rid=f"burst-{i}") for i in range(BURST)]
    start = threading.Barrier(BURST)

    def send(body: dict[str, object]) -> httpx.Response:
        start.wait()
        return post(url, body)

    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(send, bodies))
    statuses = [resp.status_code for resp in answers]
    assert set(statuses) <= {200, 503}, [r.text for r in answers if r.status_code not in (200, 503)]
    accepted = [resp for resp in answers if resp.status_code == 200]
    shed = [resp for resp in answers if resp.status_code == 503]
    assert accepted and shed, statuses
    for resp in shed:
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.json()["error"]["message"] == "The request queue is full."
        assert resp.json()["error"]["code"] == "queue_full"
    for resp in accepted:  # every accepted request ran to its end
        [choice] = resp.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert resp.json()["usage"]["completion_tokens"] == 16
    r = fleet.redis()
    shed_rids = [b["rid"] for b, a in zip(bodies, answers, strict=True) if a.status_code == 503]
    assert not any(r.exists(fleet.keys.state(str(rid))) for rid in shed_rids)  # never submitted
    # Drained: a request later is accepted again.
    assert post(url, completion("After the burst,", 2)).status_code == 200


def test_the_rate_limit_is_shared_by_two_api_replicas(fleet: Fleet) -> None:
    one, two = fleet.url("lim1"), fleet.url("lim2")
    body = completion("Hello", 2)
    assert post(one, body, KEY).status_code == 200
    assert post(two, body, KEY).status_code == 200  # the burst of 2 is spent, fleet-wide
    for url in (one, two):
        resp = post(url, body, KEY)
        assert resp.status_code == 429, resp.text
        assert 1 <= int(resp.headers["retry-after"]) <= 20
        error = resp.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "Rate limit reached" in error["message"]
    assert post(two, body).status_code == 401  # no key, no admission
    names = list(fleet.redis().scan_iter(match=f"{fleet.keys.prefix}:limit:*"))
    assert names and not any(KEY in name for name in names)


def test_the_in_flight_cap_is_fleet_wide_and_freed_at_the_end(fleet: Fleet) -> None:
    one, two = fleet.url("lim1"), fleet.url("lim2")
    r = fleet.redis()
    in_flight = fleet.keys.in_flight(limits.client_id(OTHER_KEY.encode()))
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, one, completion("Tell me a long story:", 48), OTHER_KEY)
        _wait_for(lambda: r.zcard(in_flight) == 1)
        resp = post(two, completion("Hi", 2), OTHER_KEY)
        assert resp.status_code == 429, resp.text
        assert "at most 1 in flight per API key" in resp.json()["error"]["message"]
        assert long.result().status_code == 200
    _wait_for(lambda: r.zcard(in_flight) == 0)
    assert post(two, completion("Hi", 2), OTHER_KEY).status_code == 200  # its second token


def _wait_for(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def test_a_request_past_its_timeout_ends_with_a_504_and_frees_the_scheduler(
    fleet: Fleet,
) -> None:
    url = fleet.url("api")
    long = completion("Write a very long essay about rivers:", 1500, timeout=0.5)
    resp = post(url, {**long, "rid": "late"})
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["message"] == "The request exceeded its timeout of 0.5 s."
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True},
                      timeout=60) as stream:  # fmt: skip
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "The request exceeded its timeout of 0.5 s." in events[-2]
    # The scheduler let it go: its KV is free for the next request.
    r = fleet.redis()
    _wait_for(lambda: r.hget(fleet.keys.state("late"), "status") == "aborted")
    assert post(url, completion("Next,", 2)).status_code == 200
