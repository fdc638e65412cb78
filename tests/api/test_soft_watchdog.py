"""The api's soft watchdog (the seed's, per request) on fakeredis: a request with no output for
soft_watchdog_s is logged at WARNING with its rid, tokens so far and where it waits (queued in
the stream, running on a named scheduler, waiting for the detokenizer), once per period while
it stays silent; nothing about the request changes."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis

from api.req_state import GenerateReq, ReqState
from api.soft_watchdog import SoftWatchdog
from shared import protocol
from shared.config import Settings
from shared.keys import Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.app import running_app, with_api

PERIOD_S = 0.2


def _warnings(caplog: pytest.LogCaptureFixture, rid: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "api.soft_watchdog" and r.levelno == logging.WARNING and f"rid={rid} " in
        r.getMessage()
    ]  # fmt: skip


async def _logged(caplog: pytest.LogCaptureFixture, rid: str, timeout: float = 5.0) -> str:
    async with asyncio.timeout(timeout):
        while not _warnings(caplog, rid):
            await asyncio.sleep(0.02)
    return _warnings(caplog, rid)[-1]


@pytest.fixture
def watched(settings: Settings) -> Settings:
    return with_api(settings, soft_watchdog_s=PERIOD_S)


async def test_a_request_no_scheduler_took_is_logged_as_queued(
    watched: Settings,
    fake_redis: aioredis.Redis,
    tokenizer: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="api.soft_watchdog")
    async with running_app(watched, fake_redis, tokenizer) as (_app, client):
        call = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "sw-q"}))
        message = await _logged(caplog, "sw-q")
        assert "no output for" in message and "0 tokens so far" in message
        assert "queued in the request stream" in message
        assert not call.done()  # log only: the request still waits
        call.cancel()


async def test_a_running_request_is_logged_with_its_scheduler_and_then_at_the_detokenizer(
    watched: Settings,
    fake_redis: aioredis.Redis,
    fake_server: fakeredis.FakeServer,
    tokenizer: Any,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="api.soft_watchdog")
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    async with ScriptedBackend(r, keys, tokenizer) as backend:
        async with running_app(watched, fake_redis, tokenizer) as (_app, client):
            body = {"text": "hi", "rid": "sw-r", "stream": True}
            call = asyncio.create_task(client.post("/generate", json=body))
            await backend.wait_job("sw-r")
            await backend.step("sw-r")  # 2 tokens reach the api
            caplog.clear()
            message = await _logged(caplog, "sw-r")
            assert "2 tokens so far" in message
            assert "running on scheduler scripted (epoch 1), 2 ids" in message
            await fake_redis.rpush(keys.ids("sw-r"), 11, 12, 13)  # generated, never sent
            caplog.clear()
            message = await _logged(caplog, "sw-r")
            assert "waiting for the detokenizer" in message
            assert "scheduler scripted generated 5 ids, 2 reached this replica" in message
            call.cancel()
    await r.aclose()


def _state(rid: str, silent_s: float, now: float) -> ReqState:
    req = GenerateReq(rid=rid, prompt=[1, 2], sampling=protocol.SamplingParams(), max_new_tokens=4)
    return ReqState(obj=req, index=0, prompt_tokens=2, last_time=now - silent_s)


def _manager(settings: Settings, r: aioredis.Redis, keys: Keys, *states: ReqState) -> Any:
    return SimpleNamespace(
        settings=settings, redis=r, keys=keys, rid_to_state={s.rid: s for s in states}
    )


def test_each_silent_request_is_due_once_per_period_and_forgotten_once_it_speaks(
    watched: Settings, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    now = time.monotonic()
    silent, talking, done = _state("a", 1.0, now), _state("b", 0.0, now), _state("c", 9.0, now)
    done.finished = True
    dog = SoftWatchdog(_manager(watched, fake_redis, keys, silent, talking, done))
    assert [s.rid for s in dog.due(now, 0.5)] == ["a"]
    dog.warned_at["a"] = now
    assert dog.due(now + 0.4, 0.5) == []  # warned in this period
    talking.last_time = now + 0.4  # it keeps receiving output
    assert [s.rid for s in dog.due(now + 0.5, 0.5)] == ["a"]  # the next period
    silent.last_time = now + 0.6  # output arrived
    assert dog.due(now + 0.7, 0.5) == [] and dog.warned_at == {}


async def test_with_redis_unreachable_it_still_logs_saying_so(
    watched: Settings,
    fake_server: fakeredis.FakeServer,
    fake_redis: aioredis.Redis,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="api.soft_watchdog")
    state = _state("down", 1.0, time.monotonic())
    dog = SoftWatchdog(_manager(watched, fake_redis, keys, state))
    fake_server.connected = False
    await dog.tick()
    assert "unknown: Redis unreachable" in await _logged(caplog, "down")


async def test_unknown_paused_and_finished_requests_are_told_apart(
    watched: Settings,
    fake_redis: aioredis.Redis,
    keys: Keys,
) -> None:
    now = time.monotonic()
    states = [_state(rid, 1.0, now) for rid in ("gone", "held", "ended")]
    await fake_redis.hset(keys.state("held"), mapping={"status": "queued"})
    await fake_redis.hset(keys.state("ended"), mapping={"status": "finished", "worker": "s1"})
    await fake_redis.set(keys.pause, "retract")
    where = await SoftWatchdog(_manager(watched, fake_redis, keys, *states)).where(states)
    assert where["gone"].startswith("no state in Redis")
    assert where["held"].endswith("no scheduler took it yet; the fleet is paused (retract)")
    assert where["ended"] == "finished on scheduler s1: waiting for the detokenizer to send it"


async def test_off_when_the_period_is_zero(
    watched: Settings,
    fake_redis: aioredis.Redis,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="api.soft_watchdog")
    off = with_api(watched, soft_watchdog_s=0)
    dog = SoftWatchdog(_manager(off, fake_redis, keys, _state("x", 1e6, time.monotonic())))
    await dog.tick()
    assert not _warnings(caplog, "x") and dog.warned_at == {}
