"""GET /metrics (Prometheus text format, SGLang's names under `redserve:`), readiness
(/health, /health_generate, /live) and the fleet views (/get_load, /get_server_info) through
ASGI: the values move with requests a scripted back end answers, the fleet gauges follow the
live beats (a worker gone has no series left), and /health needs a ready scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from shared import heartbeat, request_stream
from shared.config import Settings
from shared.embedded_redis import free_port
from shared.keys import Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.app import running_app, with_api
from tests.support.backend import FakeBackend
from tests.support.beats import beat_once
from tests.support.waiting import wait_until

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "queue_time_seconds")  # fmt: skip
COUNTERS = ("prompt_tokens", "generation_tokens", "cached_tokens", "num_requests",
            "num_aborted_requests", "redeliveries")  # fmt: skip
GAUGES = ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput",
          "request_stream_lag", "request_stream_pending", "redis_up")  # fmt: skip

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample `redserve:{name}` whose labels include `labels` (0 if there is none)."""
    hits = [v for (n, ls), v in samples.items() if n == f"redserve:{name}" and
            set(labels.items()) <= ls]  # fmt: skip
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else 0.0


def workers_of(samples: Samples, name: str) -> set[str]:
    return {dict(ls)["worker"] for n, ls in samples if n == f"redserve:{name}"}


async def test_metrics_are_the_text_format_with_sglangs_names(client: httpx.AsyncClient) -> None:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    families = {f.name: f.type for f in text_string_to_metric_families(resp.text)}
    for name in HISTOGRAMS:
        assert families[f"redserve:{name}"] == "histogram", name
    for name in COUNTERS:
        assert families[f"redserve:{name}"] == "counter", name
        assert f"redserve:{name}_total" in resp.text
    for name in GAUGES:
        assert families[f"redserve:{name}"] == "gauge", name
    assert 'redserve:num_requests_total{finish_reason="stop"' in resp.text


async def test_values_move_with_requests(
    client: httpx.AsyncClient, scripted: ScriptedBackend
) -> None:
    before = await scrape(client)
    body = {"text": "hi", "rid": "m1", "sampling_params": {"max_new_tokens": 6}}
    answer = asyncio.create_task(client.post("/generate", json=body))
    job = await scripted.wait_job("m1")
    first = scripted.entry("m1", 0, 2)
    first.queue_time = 0.25  # the scheduler's, on the request's first entry
    scripted.pos["m1"] = 2
    await scripted.publish("m1", first)
    moved = scripted.entry("m1", 2, 4)
    moved.epoch = 3  # a new owner, twice over (a redelivery the api never saw the middle of)
    scripted.pos["m1"] = 4
    await scripted.publish("m1", moved)
    await scripted.step("m1")  # 4..6 and the finish (length), at epoch 1: a stale owner's
    finish = scripted.entry("m1", 4, 6)
    finish.epoch = 3
    await scripted.publish("m1", finish)
    resp = await answer
    assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 6
    after = await scrape(client)

    def moved_by(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved_by("num_requests_total", finish_reason="length") == 1
    assert moved_by("num_requests_total", finish_reason="stop") == 0
    assert moved_by("generation_tokens_total") == 6
    assert moved_by("prompt_tokens_total") == len(job.input_ids)
    assert moved_by("redeliveries_total") == 2
    assert moved_by("time_to_first_token_seconds_count") == 1
    assert moved_by("inter_token_latency_seconds_count") == 2  # the entries after the first
    assert moved_by("e2e_request_latency_seconds_count") == 1
    assert moved_by("queue_time_seconds_count") == 1
    assert moved_by("queue_time_seconds_sum") == pytest.approx(0.25)
    assert moved_by("queue_time_seconds_bucket", le="0.1") == 0
    assert moved_by("queue_time_seconds_bucket", le="0.5") == 1


async def test_an_abort_counts_as_one(client: httpx.AsyncClient, scripted: ScriptedBackend) -> None:
    before = await scrape(client)
    body = {"text": "hi", "rid": "gone", "sampling_params": {"max_new_tokens": 6}}
    answer = asyncio.create_task(client.post("/generate", json=body))
    await scripted.wait_job("gone")
    await scripted.step("gone")
    assert (await client.post("/abort_request", json={"rid": "gone"})).status_code == 200
    assert (await answer).json()["meta_info"]["finish_reason"]["type"] == "abort"
    after = await scrape(client)
    for name, labels in [("num_requests_total", {"finish_reason": "abort"}),
                         ("num_aborted_requests_total", {})]:  # fmt: skip
        assert value(after, name, **labels) - value(before, name, **labels) == 1, name
    assert value(after, "generation_tokens_total") - value(before, "generation_tokens_total") == 2


async def test_fleet_gauges_follow_the_live_beats(
    client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    busy = heartbeat.SchedulerBeat(num_running=3, num_waiting=2, num_free_blocks=25,
                                   num_total_blocks=100, gen_throughput=41.5)  # fmt: skip
    await beat_once(fake_redis, keys, "sched-b", busy)
    async with fake_redis.pipeline(transaction=False) as pipe:
        detok = heartbeat.DetokenizerBeat(shards="0,1", num_states=4)
        heartbeat.beat(pipe, keys, "detok-a", detok, heartbeat.DETOKENIZER)
        await pipe.execute()
    await request_stream.ensure_group(fake_redis, keys)
    await fake_redis.xadd(keys.request_stream, {"job": b"waits"})
    samples = await scrape(client)
    assert workers_of(samples, "num_running_reqs") == {"fake-scheduler", "sched-b"}
    assert value(samples, "num_running_reqs", worker="sched-b") == 3
    assert value(samples, "num_queue_reqs", worker="sched-b") == 2
    assert value(samples, "token_usage", worker="sched-b") == pytest.approx(0.75)
    assert value(samples, "gen_throughput", worker="sched-b") == 41.5
    assert value(samples, "detokenizer_num_states", worker="detok-a") == 4
    assert value(samples, "detokenizer_num_shards", worker="detok-a") == 2
    assert value(samples, "num_workers", kind="scheduler", state="ready") == 2
    assert value(samples, "request_stream_lag") == 1
    assert value(samples, "request_stream_pending") == 0
    assert value(samples, "redis_up") == 1

    await fake_redis.delete(keys.heartbeat(heartbeat.SCHEDULER, "sched-b"))  # its TTL ran out
    samples = await scrape(client)
    assert workers_of(samples, "num_running_reqs") == {"fake-scheduler"}
    assert workers_of(samples, "token_usage") == {"fake-scheduler"}


async def test_get_load_and_server_info_list_the_live_workers(
    client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    beat = heartbeat.SchedulerBeat(num_running=1, num_waiting=2, num_free_blocks=60,
                                   num_total_blocks=64, weight_version="v7")  # fmt: skip
    await beat_once(fake_redis, keys, "sched-b", beat)
    load = (await client.get("/get_load")).json()
    assert [w["worker"] for w in load] == ["fake-scheduler", "sched-b"]
    assert load[1] == {
        "dp_rank": 1, "worker": "sched-b", "state": "ready", "num_reqs": 3,
        "num_waiting_reqs": 2, "num_tokens": 4 * 16, "token_usage": 0.0625,
    }  # fmt: skip
    info = (await client.get("/get_server_info")).json()
    schedulers = {w["id"]: w for w in info["workers"]["scheduler"]}
    assert set(schedulers) == {"fake-scheduler", "sched-b"}
    assert schedulers["sched-b"]["weight_version"] == "v7"
    assert schedulers["sched-b"]["load"]["num_queue_reqs"] == 2
    assert [w["id"] for w in info["workers"]["api"]] == [info["api"]["api_id"]]


@pytest.fixture
async def bare(settings: Settings, tokenizer: Any) -> AsyncIterator[tuple[FastAPI, Any, Any]]:
    """An app on a Redis of its own, where no scheduler beats (the autouse one beats on
    the fixtures' server), and a connection to that Redis."""
    server = fakeredis.FakeServer()
    r = fakeredis.FakeAsyncRedis(server=server)
    conf = with_api(settings, health_generate_timeout_s=0.5)
    async with running_app(conf, r, tokenizer) as (app, client):
        yield app, client, r
    await r.aclose()


async def test_health_needs_a_ready_scheduler(
    bare: tuple[FastAPI, httpx.AsyncClient, aioredis.Redis], keys: Keys
) -> None:
    _app, client, r = bare
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "No scheduler is running."
    assert (await client.get("/live")).status_code == 200  # alive all the same
    loading = heartbeat.SchedulerBeat(num_running=0, num_waiting=0, num_free_blocks=0,
                                      num_total_blocks=0, state="loading",
                                      progress="timing kernels")  # fmt: skip
    await beat_once(r, keys, "sched-a", loading)
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert "sched-a is loading (timing kernels)" in resp.json()["error"]["message"]
    await beat_once(r, keys, "sched-a")  # ready
    assert (await client.get("/health")).status_code == 200


async def test_health_generate_is_503_when_no_token_comes_back(
    bare: tuple[FastAPI, httpx.AsyncClient, aioredis.Redis], keys: Keys
) -> None:
    app, client, r = bare
    assert "No scheduler is running" in (await client.get("/health_generate")).text
    await beat_once(r, keys, "sched-a")  # beats, but nothing answers the job
    resp = await client.get("/health_generate")
    assert resp.status_code == 503
    assert "within 0.5 s" in resp.json()["error"]["message"]

    async def aborted() -> bool:  # in the background: the abort, then the local state goes
        found = [k async for k in r.scan_iter(match=keys.abort("HEALTH_CHECK_*"))]
        return bool(found) and not app.state.manager.rid_to_state

    await wait_until(aborted, timeout=5)
    samples = await scrape(client)
    assert value(samples, "num_requests_total", finish_reason="abort") == 0  # not counted


async def test_health_generate_is_200_when_a_token_comes_back(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    assert (await client.get("/health_generate")).status_code == 200
    assert backend.jobs[-1].sampling.max_new_tokens == 1


async def test_metrics_answer_while_redis_is_away(settings: Settings, tokenizer: Any) -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    async with running_app(settings, dead, tokenizer) as (_app, client):
        samples = await scrape(client)
        assert value(samples, "redis_up") == 0
        assert not workers_of(samples, "num_running_reqs")
        assert (await client.get("/get_load")).status_code == 503
    await dead.aclose()
