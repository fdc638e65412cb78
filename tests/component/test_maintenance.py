"""The jobs tier's maintenance crons on a real redis-server (arq's job status needs one):
streams trimmed to what the scheduler group still needs, old dead letters dropped, expired
files and stale parts swept, lapsed in-flight slots dropped, orphaned batches given a new run
(and failed after MAX_RUNS)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from arq.constants import in_progress_key_prefix

from shared import batches, job_queue
from shared.batches import BatchRecord
from shared.config import Settings
from shared.file_store import FileStore
from shared.keys import SCHEDULER_GROUP, Keys
from workers import maintenance


@pytest.fixture
def ctx(real_redis: aioredis.Redis, keys: Keys, tmp_path: Path) -> dict[str, Any]:
    settings = Settings(key_prefix=keys.prefix, files_dir=str(tmp_path))
    return {"settings": settings, "redis": real_redis}


async def test_streams_keep_only_what_schedulers_still_need(
    ctx: dict[str, Any], real_redis: aioredis.Redis, keys: Keys
) -> None:
    stream = keys.request_stream
    await real_redis.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
    ids = [await real_redis.xadd(stream, {"n": str(i)}) for i in range(6)]
    read = await real_redis.xreadgroup(SCHEDULER_GROUP, "s1", {stream: ">"}, count=4)
    assert len(read[0][1]) == 4
    await real_redis.xack(stream, SCHEDULER_GROUP, ids[0], ids[1], ids[3])  # ids[2] pending
    old = int((time.time() - 8 * 86400) * 1000)
    await real_redis.xadd(keys.dead_letters, {"rid": "old"}, id=f"{old}-0")
    await real_redis.xadd(keys.dead_letters, {"rid": "new"})
    assert await maintenance.trim_streams(ctx) == 3
    left = [entry_id for entry_id, _ in await real_redis.xrange(stream)]
    assert left == ids[2:]  # the pending one, the acked one after it, the undelivered two
    letters = await real_redis.xrange(keys.dead_letters)
    assert [fields[b"rid"] for _, fields in letters] == [b"new"]
    assert await maintenance.trim_streams(ctx) == 0  # nothing more until acks move on


async def test_sweep_drops_expired_files_stale_parts_and_lapsed_slots(
    ctx: dict[str, Any], real_redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    store = FileStore(real_redis, keys, tmp_path)
    for file_id, expires_after_s in (("file-old", -1), ("file-keep", None)):
        await store.fill(file_id, lambda f: f.write(b"{}\n"))
        await store.add(file_id, "x.jsonl", "batch", expires_after_s)
    stale, fresh = tmp_path / "file-crash.part", tmp_path / "file-upload.part"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    long_ago = time.time() - maintenance.STALE_PART_S - 60
    os.utime(stale, (long_ago, long_ago))
    slots = keys.in_flight("client")
    await real_redis.zadd(slots, {"gone": time.time() - 5, "live": time.time() + 60})
    await real_redis.zadd(keys.batches, {"batch_expired": 1})
    assert await maintenance.sweep(ctx) == 3
    assert await store.get("file-old") is None and not store.path("file-old").exists()
    assert await store.get("file-keep") is not None
    assert not stale.exists() and fresh.exists()
    assert await real_redis.zrange(slots, 0, -1) == [b"live"]
    assert await real_redis.zcard(keys.batches) == 0


async def _active(r: aioredis.Redis, keys: Keys, batch_id: str, attempt: int = 0) -> None:
    now = int(time.time())
    await batches.create(r, keys, BatchRecord(
        id=batch_id, endpoint="/v1/completions", input_file_id="file-x", completion_window="24h",
        status="in_progress", created_at=now, expires_at=now + 86400, attempt=attempt))  # fmt: skip


async def test_an_orphaned_batch_gets_a_new_run_and_a_live_one_is_left_alone(
    ctx: dict[str, Any], real_redis: aioredis.Redis, keys: Keys
) -> None:
    for batch_id in ("orphan", "leased", "queued"):
        await _active(real_redis, keys, batch_id)
    await real_redis.set(keys.batch_lease("leased"), "someone", px=10_000)
    await job_queue.enqueue_batch(real_redis, keys, "queued", 0)
    assert await maintenance.recover_batches(ctx) == 1
    orphan = await batches.get(real_redis, keys, "orphan")
    assert orphan is not None and orphan.attempt == 1 and orphan.status == "in_progress"
    queue = {q.decode() for q in await real_redis.zrange(keys.jobs_queue, 0, -1)}
    assert queue == {job_queue.batch_job_id(keys, b, a) for b, a in (("orphan", 1), ("queued", 0))}
    payload = await real_redis.get("arq:job:" + job_queue.batch_job_id(keys, "orphan", 1))
    job = job_queue.deserialize(payload)  # msgpack, never pickle
    assert job["f"] == job_queue.RUN_BATCH and list(job["a"]) == ["orphan", 1]
    assert await maintenance.recover_batches(ctx) == 0  # its new run is queued


async def test_a_run_in_progress_without_a_lease_is_rerun_only_when_seen_so_twice(
    ctx: dict[str, Any], real_redis: aioredis.Redis, keys: Keys
) -> None:
    await _active(real_redis, keys, "starting")
    await _active(real_redis, keys, "dead")
    for batch_id in ("starting", "dead"):  # arq has started both jobs; neither holds a lease
        job_id = job_queue.batch_job_id(keys, batch_id, 0)
        await real_redis.set(in_progress_key_prefix + job_id, b"1", px=60_000)
    ctx[maintenance.LEASELESS] = set()  # as the jobs worker's startup makes it
    # arq runs each cron pass with a copy of the worker's ctx.
    assert await maintenance.recover_batches({**ctx}) == 0  # a run may be about to take its lease
    await real_redis.set(keys.batch_lease("starting"), "run-0", px=10_000)  # and one did
    assert await maintenance.recover_batches({**ctx}) == 1
    dead = await batches.get(real_redis, keys, "dead")
    starting = await batches.get(real_redis, keys, "starting")
    assert dead is not None and dead.attempt == 1
    assert starting is not None and starting.attempt == 0


async def test_a_batch_whose_runs_keep_dying_fails(
    ctx: dict[str, Any], real_redis: aioredis.Redis, keys: Keys
) -> None:
    await _active(real_redis, keys, "doomed", attempt=maintenance.MAX_RUNS - 1)
    await maintenance.recover_batches(ctx)
    doomed = await batches.get(real_redis, keys, "doomed")
    assert doomed is not None and doomed.status == "failed" and doomed.errors
    assert not await real_redis.sismember(keys.active_batches, "doomed")
    assert await maintenance.recover_batches(ctx) == 0
