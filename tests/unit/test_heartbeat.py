"""Worker heartbeats (shared/heartbeat.py) on fakeredis: what a beat writes, reading it back,
and that only workers with a fresh beat count as live."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import heartbeat
from shared.heartbeat import SCHEDULER, SchedulerBeat
from shared.keys import HEARTBEAT_TTL_S, Keys

BEAT = SchedulerBeat(num_running=3, num_waiting=1, num_free_blocks=10, num_total_blocks=32)


async def _beat(r: aioredis.Redis, keys: Keys, worker_id: str) -> None:
    pipe = r.pipeline(transaction=True)
    heartbeat.beat(pipe, keys, worker_id, BEAT)
    await pipe.execute()


async def test_a_beat_reads_back_stamped_and_expires(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await _beat(fake_redis, keys, "host-a-1")
    read = await heartbeat.read(fake_redis, keys, "host-a-1")
    assert read is not None and read.updated_at > 0
    assert (read.num_running, read.num_waiting) == (3, 1)
    assert (read.num_free_blocks, read.num_total_blocks) == (10, 32)
    assert 0 < await fake_redis.ttl(keys.heartbeat(SCHEDULER, "host-a-1")) <= HEARTBEAT_TTL_S


async def test_only_fresh_beats_are_live_workers(fake_redis: aioredis.Redis, keys: Keys) -> None:
    assert await heartbeat.read(fake_redis, keys, "nobody") is None
    await _beat(fake_redis, keys, "host-a-1")
    await _beat(fake_redis, keys, "host-b-1")
    assert sorted(await heartbeat.live_workers(fake_redis, keys, SCHEDULER)) == [
        "host-a-1",
        "host-b-1",
    ]
    assert await heartbeat.live_workers(fake_redis, keys, SCHEDULER, "host-b") == ["host-b-1"]
    await fake_redis.delete(keys.heartbeat(SCHEDULER, "host-a-1"))  # as when its TTL ran out
    assert await heartbeat.live_workers(fake_redis, keys, SCHEDULER) == ["host-b-1"]


async def test_a_forgotten_worker_leaves_its_kind_at_once(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await _beat(fake_redis, keys, "host-a-1")
    pipe = fake_redis.pipeline(transaction=False)
    heartbeat.forget(pipe, keys, "host-a-1", SCHEDULER)
    await pipe.execute()
    assert await heartbeat.live_workers(fake_redis, keys, SCHEDULER) == []
    assert await fake_redis.zcard(keys.worker_registry(SCHEDULER)) == 0
