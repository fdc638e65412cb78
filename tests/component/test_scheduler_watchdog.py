"""The scheduler loop under its watchdog (fakeredis): an idle loop keeps stamping its
progress (it blocks at most idle_block_ms on the job stream), and so does one riding out a
Redis outage (it backs off between retries), so neither trips the watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import fakeredis
import pytest
import redis.asyncio as aioredis

from shared.keys import Keys
from tests.support.scheduler_loop import ScriptedRunner, make_loop
from workers.scheduler.loop import MAX_BACKOFF_S
from workers.scheduler.watchdog import Watchdog


async def test_a_real_loop_idle_or_riding_out_a_redis_outage_does_not_trip_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="workers.scheduler.loop")
    server = fakeredis.FakeServer()
    r: aioredis.Redis = fakeredis.FakeAsyncRedis(server=server)
    loop = make_loop(r, Keys("wd"), ScriptedRunner())
    stalls: list[float] = []
    timeout_s = MAX_BACKOFF_S + 1.0  # above the longest sleep between outage retries
    dog = Watchdog(timeout_s, lambda: loop.last_progress, on_stall=stalls.append)
    task = asyncio.create_task(loop.run())
    dog.start()
    try:
        await asyncio.sleep(timeout_s + 0.5)  # idle: blocking reads of idle_block_ms
        server.connected = False  # every call fails: run() backs off and retries
        await asyncio.sleep(timeout_s + 0.5)  # longer than the watchdog's timeout
        server.connected = True
        await asyncio.sleep(0.5)
        assert not stalls
        assert any("redis unavailable" in rec.getMessage() for rec in caplog.records)
        assert time.monotonic() - loop.last_progress < timeout_s  # still iterating
    finally:
        dog.stop()
        loop.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await r.aclose()
