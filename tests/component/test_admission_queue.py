"""api.admission.QueueBound on fakeredis: what counts as queued (undelivered stream entries,
schedulers' waiting requests, this replica's admissions not submitted yet or submitted since
the last read), counted once each, and what does not (jobs a scheduler took)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from api.admission import REFRESH_S, QueueBound
from api.errors import ServiceUnavailable
from shared import heartbeat, protocol, request_stream
from shared.keys import SCHEDULER_GROUP, Keys
from tests.support.beats import beat_once


def job(rid: str, priority: int = 0) -> protocol.GenerateJob:
    return protocol.GenerateJob(
        rid=rid, input_ids=[1, 2], sampling=protocol.SamplingParams(max_new_tokens=1),
        detok=protocol.DetokParams(api_id="a"), priority=priority,
    )  # fmt: skip


async def submit(r: aioredis.Redis, keys: Keys, rid: str, priority: int = 0) -> None:
    async with r.pipeline(transaction=True) as pipe:
        request_stream.submit(pipe, keys, job(rid, priority))
        await pipe.execute()


async def fresh_estimate(bound: QueueBound) -> int:
    """The estimate right after a read of the fleet."""
    await asyncio.sleep(REFRESH_S)
    await bound.reserve(0)
    return bound.estimate()


async def test_admissions_not_submitted_yet_count(fake_redis: aioredis.Redis, keys: Keys) -> None:
    bound = QueueBound(fake_redis, keys, max_queued=2)
    await bound.reserve(1)
    await bound.reserve(1)
    with pytest.raises(ServiceUnavailable, match="The request queue is full."):
        await bound.reserve(1)
    bound.cancel(1)  # that one failed validation: nothing was submitted
    await bound.reserve(1)
    with pytest.raises(ServiceUnavailable):
        await bound.reserve(1)


async def test_a_batch_over_the_room_left_is_refused_whole(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    bound = QueueBound(fake_redis, keys, max_queued=3)
    await bound.reserve(2)
    with pytest.raises(ServiceUnavailable):
        await bound.reserve(2)
    assert bound.estimate() == 2


async def test_a_submitted_job_counts_once_before_and_after_the_next_read(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await request_stream.ensure_group(fake_redis, keys)
    bound = QueueBound(fake_redis, keys, max_queued=10)
    await bound.reserve(1)
    await submit(fake_redis, keys, "a")
    bound.on_submitted(1)
    assert bound.estimate() == 1
    assert await fresh_estimate(bound) == 1  # now in XLEN, no more in the local count


async def test_jobs_a_scheduler_took_leave_the_count_its_waiting_ones_join_it(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await request_stream.ensure_group(fake_redis, keys)
    for rid in "abc":
        await submit(fake_redis, keys, rid)
    bound = QueueBound(fake_redis, keys, max_queued=10)
    assert await fresh_estimate(bound) == 3
    await fake_redis.xreadgroup(SCHEDULER_GROUP, "s1", {keys.request_stream: ">"}, count=2)
    assert await fresh_estimate(bound) == 1
    beat = heartbeat.SchedulerBeat(num_running=1, num_waiting=1, num_free_blocks=1,
                                   num_total_blocks=8)  # fmt: skip
    await beat_once(fake_redis, keys, "s1", beat)
    await beat_once(fake_redis, keys, "s2", beat)
    assert await fresh_estimate(bound) == 3  # 1 in the stream + 1 waiting on each
    async with fake_redis.pipeline(transaction=False) as pipe:
        heartbeat.forget(pipe, keys, "s2")  # a scheduler that stopped counts no more
        await pipe.execute()
    assert await fresh_estimate(bound) == 2
    await submit(fake_redis, keys, "urgent", priority=5)  # every priority band counts
    await submit(fake_redis, keys, "later", priority=-5)
    assert await fresh_estimate(bound) == 4


async def test_a_stream_without_its_group_counts_every_entry(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await submit(fake_redis, keys, "a")  # Redis restarted: the group is gone until a scheduler
    bound = QueueBound(fake_redis, keys, max_queued=1)
    with pytest.raises(ServiceUnavailable):
        await bound.reserve(1)


async def test_no_bound_reads_nothing(keys: Keys) -> None:
    bound = QueueBound(None, keys, max_queued=0)  # type: ignore[arg-type]
    for _ in range(100):
        await bound.reserve(5)


async def test_concurrent_requests_share_one_read(fake_redis: aioredis.Redis, keys: Keys) -> None:
    await request_stream.ensure_group(fake_redis, keys)
    bound = QueueBound(fake_redis, keys, max_queued=5)
    calls = 0
    read = bound._read

    async def counted() -> None:
        nonlocal calls
        calls += 1
        await read()

    bound._read = counted  # type: ignore[method-assign]
    results = await asyncio.gather(*(bound.reserve(1) for _ in range(8)), return_exceptions=True)
    assert calls == 1
    assert sum(isinstance(r, ServiceUnavailable) for r in results) == 3
