"""Admission at the api (fakeredis, the scripted back end): the fleet queue bound (503 with
Retry-After), per-key rate limits and in-flight caps (429 with Retry-After, in SGLang's and
OpenAI's error shapes; slots given back however a request ends), and `priority` / `timeout`
onto the job (past its timeout, a request nobody ends ends with a 504)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from api.admission import REFRESH_S
from api.loop_lag import OVERLOAD_LAG_S, WINDOW_S, LoopLag
from shared import heartbeat, limits
from shared.config import Settings
from shared.keys import Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.app import running_app, sse_events, with_api
from tests.support.beats import READY, beat_once

KEY_A, KEY_B = "key-a", "key-b"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def gen(rid: str, **extra: Any) -> dict[str, Any]:
    return {"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 4}, **extra}


async def finished(client: httpx.AsyncClient, scripted: ScriptedBackend, body: dict[str, Any],
                   path: str = "/generate", **kw: Any) -> httpx.Response:  # fmt: skip
    """`body`'s answer, the scripted back end running it to the end."""
    task = asyncio.create_task(client.post(path, json=body, **kw))
    await scripted.wait_job(body["rid"])
    await scripted.finish(body["rid"])
    return await task


async def busy_scheduler(r: aioredis.Redis, keys: Keys, num_waiting: int) -> None:
    beat = heartbeat.SchedulerBeat(**{**_fields(READY), "num_waiting": num_waiting})
    await beat_once(r, keys, "busy", beat)


def _fields(beat: heartbeat.SchedulerBeat) -> dict[str, Any]:
    return {f: getattr(beat, f) for f in beat.__struct_fields__}


async def in_flight(r: aioredis.Redis, keys: Keys, key: str = "") -> int:
    client = limits.client_id(key.encode()) if key else limits.ANONYMOUS
    return int(await r.zcard(keys.in_flight(client)))


async def eventually(check: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


# -- the fleet queue bound -----------------------------------------------------------------
async def test_a_full_fleet_queue_sheds_with_503_until_it_drains(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, scripted: ScriptedBackend,
    keys: Keys,
) -> None:  # fmt: skip
    await busy_scheduler(fake_redis, keys, num_waiting=2)  # the bound is full already
    bounded = with_api(settings, max_queued_requests=2)
    async with running_app(bounded, fake_redis, tokenizer) as (_app, client):
        resp = await client.post("/generate", json=gen("shed"))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json() == {"error": {"message": "The request queue is full."}}
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "rid": "shed2"}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"] == {"message": "The request queue is full.",
                                        "type": "server_error", "param": None,
                                        "code": "queue_full"}  # fmt: skip
        assert not await fake_redis.exists(keys.state("shed"), keys.rid_claim("shed"))
        assert "shed" not in scripted.jobs
        await busy_scheduler(fake_redis, keys, num_waiting=1)  # one started running
        await asyncio.sleep(REFRESH_S)  # the next request reads the fleet again
        resp = await finished(client, scripted, gen("room"))
        assert resp.status_code == 200, resp.text


async def test_jobs_waiting_in_the_stream_count_against_the_bound(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, keys: Keys
) -> None:
    bounded = with_api(settings, max_queued_requests=1)
    async with running_app(bounded, fake_redis, tokenizer) as (_app, client):
        body = gen("queued", stream=True, timeout=0.05)  # no scheduler takes it: it ends (504)
        first = await client.post("/generate", json=body)
        assert first.status_code == 200
        resp = await client.post("/generate", json=gen("over"))
        assert resp.status_code == 503, resp.text
        assert await fake_redis.xlen(keys.request_stream) == 1


# -- per-key limits ------------------------------------------------------------------------
async def test_the_rate_limit_429s_per_key_in_both_error_shapes(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, scripted: ScriptedBackend,
    keys: Keys,
) -> None:  # fmt: skip
    limited = with_api(settings, api_keys=[KEY_A, KEY_B], rate_limit_rps=0.1, rate_limit_burst=1)
    async with running_app(limited, fake_redis, tokenizer) as (_app, client):
        resp = await finished(client, scripted, gen("a1"), headers=bearer(KEY_A))
        assert resp.status_code == 200, resp.text
        resp = await client.post("/generate", json=gen("a2"), headers=bearer(KEY_A))
        assert resp.status_code == 429
        assert 1 <= int(resp.headers["retry-after"]) <= 10
        message = resp.json()["error"]["message"]
        assert list(resp.json()) == ["error"] and list(resp.json()["error"]) == ["message"]
        assert "Rate limit reached: at most 0.1 requests per second per API key" in message
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "rid": "a3"}
        resp = await client.post("/v1/completions", json=body, headers=bearer(KEY_A))
        assert resp.status_code == 429 and "retry-after" in resp.headers
        error = resp.json()["error"]
        assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
        assert not await fake_redis.exists(keys.state("a2"), keys.state("a3"))
        # The other key has a bucket of its own; no raw key is in any Redis key.
        resp = await finished(client, scripted, gen("b1"), headers=bearer(KEY_B))
        assert resp.status_code == 200, resp.text
        names = [k.decode() async for k in fake_redis.scan_iter(match=f"{keys.prefix}:limit:*")]
        assert len(names) == 2 and not any(KEY_A in n or KEY_B in n for n in names)


async def test_the_in_flight_cap_429s_and_every_end_gives_the_slot_back(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, scripted: ScriptedBackend,
    keys: Keys,
) -> None:  # fmt: skip
    capped = with_api(settings, max_concurrent_requests_per_key=1)
    async with running_app(capped, fake_redis, tokenizer) as (_app, client):
        held = asyncio.create_task(client.post("/generate", json=gen("held")))
        await scripted.wait_job("held")
        resp = await client.post("/generate", json=gen("second"))
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert "at most 1 in flight per API key" in resp.json()["error"]["message"]
        await client.post("/abort_request", json={"rid": "held"})  # ends aborted
        assert (await held).json()["meta_info"]["finish_reason"]["type"] == "abort"
        await eventually(lambda: _zero(fake_redis, keys))
        resp = await finished(client, scripted, gen("third"))  # finished: released too
        assert resp.status_code == 200
        await eventually(lambda: _zero(fake_redis, keys))
        resp = await finished(client, scripted, gen("stream", stream=True))
        assert sse_events(resp.text)[-1] == "[DONE]"
        await eventually(lambda: _zero(fake_redis, keys))
        resp = await client.post("/generate", json=gen("bad", input_ids=[1]))  # a 400
        assert resp.status_code == 400
        await eventually(lambda: _zero(fake_redis, keys))


async def _zero(r: aioredis.Redis, keys: Keys) -> bool:
    return await in_flight(r, keys) == 0


# -- priority and timeout ------------------------------------------------------------------
async def test_priority_and_timeout_reach_the_job(
    client: httpx.AsyncClient, scripted: ScriptedBackend
) -> None:
    resp = await finished(client, scripted, gen("p", priority=7, timeout=30))
    assert resp.status_code == 200
    job = scripted.jobs["p"]
    assert job.priority == 7 and job.deadline == pytest.approx(job.created_at + 30)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "rid": "c",
            "priority": -2, "timeout": 5.5}  # fmt: skip
    resp = await finished(client, scripted, body, "/v1/chat/completions")
    assert resp.status_code == 200
    assert scripted.jobs["c"].priority == -2
    assert scripted.jobs["c"].deadline == pytest.approx(scripted.jobs["c"].created_at + 5.5)
    resp = await finished(client, scripted, gen("plain"))
    assert scripted.jobs["plain"].priority == 0 and scripted.jobs["plain"].deadline == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": "soon"},
        {"priority": "high"},
        {"priority": 1.5},
    ],  # fmt: skip
)
async def test_bad_priority_or_timeout_is_a_400(
    client: httpx.AsyncClient, extra: dict[str, Any]
) -> None:
    resp = await client.post("/generate", json=gen("x", **extra))
    assert resp.status_code == 400, resp.text
    assert next(iter(extra)) in resp.json()["error"]["message"]


async def test_a_request_past_its_timeout_ends_with_a_504(
    client: httpx.AsyncClient, scripted: ScriptedBackend
) -> None:
    """Nobody ends it (no scheduler steps it): the api's waiter does, just past the grace."""
    resp = await client.post("/generate", json=gen("late", timeout=0.1))
    assert resp.status_code == 504
    assert resp.json() == {"error": {"message": "The request exceeded its timeout of 0.1 s."}}
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "rid": "late2", "timeout": 0.1,
            "stream": True}  # fmt: skip
    resp = await client.post("/v1/completions", json=body)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "The request exceeded its timeout of 0.1 s."


async def test_an_overloaded_replica_sheds_new_requests_and_keeps_its_redis(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, scripted: ScriptedBackend,
    keys: Keys, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    async with running_app(settings, fake_redis, tokenizer) as (app, client):
        tm = app.state.manager
        for _ in range(2):  # its loop ran late, twice in a row
            tm.loop_lag.observe(OVERLOAD_LAG_S + 0.2, time.monotonic())
        resp = await client.post("/generate", json=gen("shed"))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "overloaded" in resp.json()["error"]["message"]
        assert "shed" not in scripted.jobs
        assert not await fake_redis.exists(keys.state("shed"), keys.rid_claim("shed"))

        async def timed_out(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError

        # A heartbeat that times out meanwhile is the load, not a Redis outage.
        monkeypatch.setattr(aioredis.client.Pipeline, "execute", timed_out)
        await tm.maintenance._beat()
        assert tm.maintenance.failing_since == 0.0
        monkeypatch.undo()


def test_the_loop_lag_is_the_worst_of_the_window_and_overload_lasts() -> None:
    lag = LoopLag()
    lag.observe(0.7, now=10.0)
    assert lag.lag_s(now=10.5) == 0.7 and not lag.overloaded(now=10.5)  # one hiccup
    lag.observe(0.6, now=10.7)
    assert lag.overloaded(now=11.0)  # two in a row
    lag.observe(0.1, now=11.0)
    assert lag.lag_s(now=11.5) == 0.7 and not lag.overloaded(now=11.5)
    assert lag.lag_s(now=10.7 + WINDOW_S + 0.1) == 0.1  # the late ones left the window
