"""The jobs tier's maintenance, as arq crons (one run fleet-wide per tick, whichever jobs
worker takes it), off the request path:

- recover_batches (every 5 s): an unfinished batch whose run is gone (no lease, its arq job
  neither queued nor waiting) gets a new run (`attempt` + 1), which resumes from its journal;
  after MAX_RUNS runs it fails. A job arq has just started takes its lease a moment later, so
  one in progress without a lease is taken for dead only when an earlier pass saw it so too.
- trim_streams (every minute): each request stream loses the entries every scheduler is done
  with (XTRIM MINID below the oldest pending or undelivered one); dead letters older than
  DEAD_LETTER_KEEP_S go.
- sweep (every minute): expired files (record, then content), `.part` files left by crashes,
  listing entries whose record expired, per-key in-flight slots past their lease."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from arq.cron import CronJob, cron
from arq.jobs import Job, JobStatus

from shared import batches, job_queue
from shared.config import Settings
from shared.file_store import PART_SUFFIX, FileStore
from shared.keys import DEAD_LETTER_KEEP_S, SCHEDULER_GROUP, Keys

logger = logging.getLogger(__name__)

MAX_RUNS = 5
# A `.part` file untouched this long belongs to no live upload or batch (a batch ends within
# its 24 h window).
STALE_PART_S = 2 * 86400
_ALIVE = (JobStatus.queued, JobStatus.deferred)
# The worker's ctx holds the (batch, attempt)s its last pass saw in progress without a lease:
# a set made at startup, as arq hands each job a copy of the ctx.
LEASELESS = "leaseless_batches"


def cron_jobs(keys: Keys) -> list[CronJob]:
    every_5s = set(range(0, 60, 5))
    return [
        cron(recover_batches, name=f"{keys.prefix}:recover_batches", second=every_5s,
             run_at_startup=True, timeout=60, keep_result=0),  # fmt: skip
        cron(trim_streams, name=f"{keys.prefix}:trim_streams", second={20}, timeout=60,
             keep_result=0),  # fmt: skip
        cron(sweep, name=f"{keys.prefix}:sweep", second={40}, timeout=120, keep_result=0),
    ]


def _context(ctx: dict[str, Any]) -> tuple[Settings, aioredis.Redis, Keys]:
    settings: Settings = ctx["settings"]
    return settings, ctx["redis"], settings.redis_keys()


async def recover_batches(ctx: dict[str, Any]) -> int:
    """Give every orphaned batch a new run; the number of batches recovered."""
    _, r, keys = _context(ctx)
    arq = job_queue.arq_client(r, keys)
    recovered = 0
    leaseless: set[tuple[str, int]] = ctx.setdefault(LEASELESS, set())
    seen_before = set(leaseless)
    leaseless.clear()
    for batch_id in await batches.active(r, keys):
        record = await batches.get(r, keys, batch_id)
        if record is None or record.status in batches.TERMINAL:
            await r.srem(keys.active_batches, batch_id)  # type: ignore[misc]
            continue
        if await r.exists(keys.batch_lease(batch_id)):
            continue
        job = Job(job_queue.batch_job_id(keys, batch_id, record.attempt), arq,
                  _queue_name=keys.jobs_queue, _deserializer=job_queue.deserialize)  # fmt: skip
        status = await job.status()
        if status in _ALIVE:
            continue
        if status == JobStatus.in_progress:  # started, or its worker died holding it
            leaseless.add((batch_id, record.attempt))
            if (batch_id, record.attempt) not in seen_before:
                continue
        await _rerun(r, keys, record)
        recovered += 1
    return recovered


async def _rerun(r: aioredis.Redis, keys: Keys, record: batches.BatchRecord) -> None:
    attempt = record.attempt + 1
    if attempt >= MAX_RUNS:
        message = f"The batch's run stopped {attempt} times; giving up."
        errors = {"object": "list", "data": [{"code": "batch_runs_exhausted", "message": message}]}
        await batches.transition(r, keys, record.id, "failed", errors=errors)
        logger.error("batch %s failed: %s", record.id, message)
        return
    await batches.set_fields(r, keys, record.id, attempt=attempt)
    await job_queue.enqueue_batch(r, keys, record.id, attempt)
    logger.warning("batch %s (%s) had no live run: run %d queued", record.id, record.status,
                   attempt)  # fmt: skip


async def trim_streams(ctx: dict[str, Any]) -> int:
    """Entries dropped from the request streams and the dead-letter stream."""
    _, r, keys = _context(ctx)
    dropped = 0
    for stream in keys.request_streams:
        floor = await _oldest_needed(r, stream)
        if floor is not None:
            dropped += await r.xtrim(stream, minid=floor, approximate=False)
    cutoff_ms = int((time.time() - DEAD_LETTER_KEEP_S) * 1000)
    dropped += await r.xtrim(keys.dead_letters, minid=f"{cutoff_ms}-0", approximate=False)
    return dropped


async def _oldest_needed(r: aioredis.Redis, stream: str) -> str | None:
    """The id below which every entry was read and acknowledged by the scheduler group;
    None when there is no group (or no stream) yet."""
    try:
        groups = await r.xinfo_groups(stream)
    except aioredis.ResponseError:
        return None
    group = next((g for g in groups if _text(g["name"]) == SCHEDULER_GROUP), None)
    if group is None:
        return None
    ms, seq = (int(part) for part in _text(group["last-delivered-id"]).split("-"))
    floor = f"{ms}-{seq + 1}"  # the first entry not yet delivered
    pending = await r.xpending(stream, SCHEDULER_GROUP)
    if pending and pending.get("pending"):
        floor = min(floor, _text(pending["min"]), key=_id_key)
    return floor


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def sweep(ctx: dict[str, Any]) -> int:
    """Expired files, stale parts, dangling listing entries, lapsed in-flight slots."""
    settings, r, keys = _context(ctx)
    store = FileStore(r, keys, settings.files_path())
    now = time.time()
    swept = 0
    for file_id in [_text(i) for i in await r.zrange(keys.files, 0, -1)]:
        record = await store.get(file_id)
        if record is None:
            await r.zrem(keys.files, file_id)
        elif record.expires_at is not None and record.expires_at <= now:
            await store.delete(file_id)
            swept += 1
    swept += await asyncio.to_thread(_drop_stale_parts, store.root, now)
    for batch_id in [_text(i) for i in await r.zrange(keys.batches, 0, -1)]:
        if not await r.exists(keys.batch(batch_id)):
            await r.zrem(keys.batches, batch_id)
    async for key in r.scan_iter(match=keys.in_flight("*"), count=500):
        swept += await r.zremrangebyscore(key, "-inf", now)
    return swept


def _drop_stale_parts(root: Path, now: float) -> int:
    if not root.is_dir():
        return 0
    dropped = 0
    for part in root.glob(f"*{PART_SUFFIX}"):
        try:
            if now - part.stat().st_mtime > STALE_PART_S:
                part.unlink()
                dropped += 1
        except FileNotFoundError:
            continue
    return dropped
