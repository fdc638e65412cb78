"""Sharded request streams (Keys.stream_shards > 1), as a Redis Cluster fleet runs them, on
fakeredis: a request's keys share its stream shard's hash slot, the shards' slots spread
over a cluster's nodes, and the scheduler loop reads, runs, acks and reclaims jobs of every
shard, one TokenBatch per step still (published after the step's per-shard scripts)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from shared import request_stream
from shared.keys import SCHEDULER_GROUP, Keys
from tests.support.scheduler_loop import (
    ScriptedRunner,
    entries_of,
    make_idle,
    make_loop,
    received,
    submit,
    subscribe,
)

SHARDED = Keys("shards", stream_shards=4)
RIDS = [f"r{i}" for i in range(8)]
# The slots of a 3-node cluster as `redis-cli --cluster create` splits them.
NODE_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))


def _slot(key: str) -> int:
    return key_slot(key.encode())


def test_a_requests_keys_share_the_slot_of_its_stream_shard() -> None:
    for rid in RIDS:
        stream = SHARDED.request_stream_of("high", SHARDED.shard(rid))
        names = [SHARDED.state(rid), SHARDED.ids(rid), SHARDED.abort(rid), SHARDED.events(rid)]
        assert {_slot(k) for k in [*names, SHARDED.rid_claim(rid), stream]} == {_slot(stream)}
    assert len({SHARDED.shard(rid) for rid in RIDS}) > 1


def test_the_shards_spread_evenly_over_a_clusters_nodes() -> None:
    keys = Keys(stream_shards=6)
    nodes = [
        next(n for n, (low, high) in enumerate(NODE_RANGES) if low <= _slot(s) <= high)
        for s in keys.request_streams[1::3]  # each shard's default band
    ]
    assert sorted(nodes) == [0, 0, 1, 1, 2, 2]


def test_an_entry_ref_names_its_shard_and_band() -> None:
    for shard, band in [(0, ""), (0, "low"), (3, ""), (2, "high")]:
        ref = request_stream.ref(band, b"1-0", shard)
        assert request_stream.locate(SHARDED, ref) == (SHARDED.request_stream_of(band, shard),
                                                       b"1-0")  # fmt: skip
    assert request_stream.ref("", b"1-0") == b"1-0"  # one shard: refs as before


async def _pending(r: aioredis.Redis) -> int:
    return sum([int((await r.xpending(s, SCHEDULER_GROUP))["pending"])
                for s in SHARDED.request_streams])  # fmt: skip


async def test_jobs_of_every_shard_run_and_come_out_one_batch_per_step(
    fake_redis: aioredis.Redis,
) -> None:
    runner = ScriptedRunner({rid: [5, 6] for rid in RIDS})
    loop = make_loop(fake_redis, SHARDED, runner)
    pubsub = await subscribe(fake_redis, SHARDED)
    for rid in RIDS:
        await submit(fake_redis, SHARDED, rid, max_new_tokens=2)
    await loop.run(burst=True)
    batches = await received(pubsub)

    assert len(batches) == len(runner.steps)
    for rid in RIDS:
        assert [e.token_ids for e in entries_of(batches, rid)] == [[5], [6]]
        assert await fake_redis.lrange(SHARDED.ids(rid), 0, -1) == [b"5", b"6"]
    assert await _pending(fake_redis) == 0
    assert [await fake_redis.xlen(s) for s in SHARDED.request_streams] == [0] * 12


async def test_a_dead_schedulers_jobs_on_several_shards_are_reclaimed(
    fake_redis: aioredis.Redis,
) -> None:
    for rid in RIDS:
        await submit(fake_redis, SHARDED, rid, max_new_tokens=2)
    await request_stream.ensure_group(fake_redis, SHARDED)
    taken = await request_stream.read(fake_redis, SHARDED, "dead", len(RIDS), None)
    assert len(taken) == len(RIDS)
    for entry_ref, _job in taken:
        stream, entry_id = request_stream.locate(SHARDED, entry_ref)
        assert stream in SHARDED.request_streams
        await make_idle(fake_redis, SHARDED, "dead", entry_id, stream=stream)
    runner = ScriptedRunner({rid: [7, 8] for rid in RIDS})
    loop = make_loop(fake_redis, SHARDED, runner, scheduler={"reclaim_every_s": 0.001})
    await loop.run(burst=True)

    for rid in RIDS:
        assert await fake_redis.lrange(SHARDED.ids(rid), 0, -1) == [b"7", b"8"]
    assert await _pending(fake_redis) == 0


async def test_a_read_takes_up_to_its_count_however_the_jobs_lie_over_the_shards(
    fake_redis: aioredis.Redis,
) -> None:
    crowded = [rid for rid in (f"c{i}" for i in range(200)) if SHARDED.shard(rid) == 2][:9]
    spread = [f"s{i}" for i in range(6)]
    for rid in crowded + spread:
        await submit(fake_redis, SHARDED, rid)
    await request_stream.ensure_group(fake_redis, SHARDED)

    one = await request_stream.read(fake_redis, SHARDED, "sched", 1, None)
    most = await request_stream.read(fake_redis, SHARDED, "sched", 11, None)
    rest = await request_stream.read(fake_redis, SHARDED, "sched", 11, None)

    assert [len(one), len(most), len(rest)] == [1, 11, 3]  # never over, none left behind
    taken = [job.rid for _ref, job in one + most + rest if job is not None]
    assert sorted(taken) == sorted(crowded + spread)


async def test_a_process_with_another_shard_count_than_the_fleet_s_refuses_to_run(
    fake_redis: aioredis.Redis,
) -> None:
    await request_stream.check_layout(fake_redis, SHARDED)  # the first one sets it
    await request_stream.check_layout(fake_redis, SHARDED)  # the same count: fine
    other = Keys(SHARDED.prefix, stream_shards=2)
    with pytest.raises(request_stream.LayoutMismatch, match="runs 4 request stream shard"):
        await request_stream.check_layout(fake_redis, other)
    loop = make_loop(fake_redis, other, ScriptedRunner({}))
    with pytest.raises(request_stream.LayoutMismatch):
        await loop.run(burst=True)
