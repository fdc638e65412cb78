"""A scheduler's heartbeat without a scheduler: what a fake back end shows the api so that its
readiness (/health needs a ready scheduler) sees one. Beats every BEAT_EVERY_S, well inside
the heartbeat TTL, and rides out Redis errors (a restarted or full Redis) like a real tier."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import heartbeat
from shared.keys import Keys

BEAT_EVERY_S = 1.0
READY = heartbeat.SchedulerBeat(
    num_running=0, num_waiting=0, num_free_blocks=64, num_total_blocks=64, state="ready"
)


async def beat_once(
    r: aioredis.Redis, keys: Keys, worker_id: str, beat: heartbeat.SchedulerBeat = READY
) -> None:
    async with r.pipeline(transaction=False) as pipe:
        heartbeat.beat(pipe, keys, worker_id, beat)
        await pipe.execute()


@contextlib.asynccontextmanager
async def scheduler_beating(
    r: aioredis.Redis, keys: Keys, worker_id: str, beat: heartbeat.SchedulerBeat = READY
) -> AsyncIterator[None]:
    """`worker_id` beats `beat` while the block runs; its beat is deleted after."""

    async def run() -> None:
        while True:
            with contextlib.suppress(RedisError, OSError):
                await beat_once(r, keys, worker_id, beat)
            await asyncio.sleep(BEAT_EVERY_S)

    with contextlib.suppress(RedisError, OSError):
        await beat_once(r, keys, worker_id, beat)  # there before the block starts
    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(RedisError, OSError):
            async with r.pipeline(transaction=False) as pipe:
                heartbeat.forget(pipe, keys, worker_id, heartbeat.SCHEDULER)
                await pipe.execute()
