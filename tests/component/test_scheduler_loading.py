"""A scheduler beats state="loading" with a progress text while its model loads (before its
loop exists, from a thread): the progress follows what the scheduler's modules log, and a
load that fails takes the beat away at once. On a real redis-server (the beat connects by URL,
as the scheduler process does)."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from shared import heartbeat
from shared.keys import Keys
from tests.support.waiting import wait_until
from workers.scheduler.loading import LoadingBeat


async def test_the_loading_beat_shows_progress_and_goes_on_failure(
    redis_url: str, real_redis: aioredis.Redis, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.scheduler")  # as --log-level INFO does

    async def progress() -> str | None:
        beat = await heartbeat.read(real_redis, keys, "sched-l")
        return f"{beat.state}: {beat.progress}" if beat else None

    async def shows(text: str) -> bool:
        return await progress() == text

    with pytest.raises(RuntimeError), LoadingBeat(redis_url, keys, "sched-l", every_s=0.05):
        await wait_until(lambda: shows("loading: starting"))
        logging.getLogger("workers.scheduler.engine.model_runner").info("timing %s", "kernels")
        await wait_until(lambda: shows("loading: timing kernels"))
        raise RuntimeError("the weights do not fit")
    assert await progress() is None
    assert await heartbeat.live_workers(real_redis, keys, heartbeat.SCHEDULER) == []


async def test_a_finished_load_leaves_its_beat_for_the_loop_to_overwrite(
    redis_url: str, real_redis: aioredis.Redis, keys: Keys
) -> None:
    with LoadingBeat(redis_url, keys, "sched-m", every_s=0.05):
        await wait_until(lambda: real_redis.exists(keys.heartbeat("scheduler", "sched-m")))
    beat = await heartbeat.read(real_redis, keys, "sched-m")
    assert beat is not None and beat.state == "loading"  # until the loop's first beat
