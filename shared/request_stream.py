"""The commands on the request stream (`req`, group `schedulers`) and its dead letters.

The api submits GenerateJob entries; schedulers read them through the consumer group, only
as many as they have room for, take over those of dead schedulers (`reclaim`), and ack each
one after its request finished (in shared.ownership's fenced step script). A job delivered
too often is moved to the dead-letter stream (`dead_letter`), which `redserve dlq` manages.
"""

from __future__ import annotations

import logging

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import protocol, request_state
from shared.keys import DEAD_LETTER_MAXLEN, REQUEST_STREAM_MAXLEN, SCHEDULER_GROUP, Keys

logger = logging.getLogger(__name__)

_FIELD = b"job"


async def ensure_group(r: aioredis.Redis, keys: Keys) -> None:
    """Create the consumer group (and the stream) if missing; Redis restarts drop it."""
    try:
        await r.xgroup_create(keys.request_stream, SCHEDULER_GROUP, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def submit(pipe: aioredis.client.Pipeline, keys: Keys, job: protocol.GenerateJob) -> None:
    """Queue XADD of `job` on `pipe` (the caller executes the pipeline)."""
    pipe.xadd(
        keys.request_stream,
        {_FIELD: protocol.encode(job)},
        maxlen=REQUEST_STREAM_MAXLEN,
        approximate=True,
    )


async def read(
    r: aioredis.Redis, keys: Keys, consumer: str, count: int, block_ms: int | None
) -> list[tuple[bytes, protocol.GenerateJob | None]]:
    """Read up to `count` new jobs for `consumer`. Undecodable entries come back as None
    so the caller can ack them (a bad job must not be redelivered forever)."""
    try:
        resp = await r.xreadgroup(
            SCHEDULER_GROUP, consumer, {keys.request_stream: ">"}, count=count, block=block_ms
        )
    except ResponseError as e:
        if "NOGROUP" not in str(e):
            raise
        await ensure_group(r, keys)
        return []
    out: list[tuple[bytes, protocol.GenerateJob | None]] = []
    for _stream, entries in resp or []:
        for entry_id, fields in entries:
            out.append((entry_id, _decode_job(entry_id, fields)))
    return out


async def reclaim(
    r: aioredis.Redis, keys: Keys, consumer: str, min_idle_ms: int, count: int, cursor: bytes
) -> tuple[bytes, list[tuple[bytes, protocol.GenerateJob | None]]]:
    """XAUTOCLAIM up to `count` entries idle at least `min_idle_ms` (their owner stopped
    renewing them: dead or frozen) from `cursor` on; returns the next cursor and the jobs."""
    try:
        resp = await r.xautoclaim(
            keys.request_stream, SCHEDULER_GROUP, consumer, min_idle_ms, cursor, count=count
        )
    except ResponseError as e:
        if "NOGROUP" not in str(e):
            raise
        await ensure_group(r, keys)
        return b"0-0", []
    next_cursor, entries = resp[0], resp[1]
    jobs = [(entry_id, _decode_job(entry_id, fields)) for entry_id, fields in entries if fields]
    return next_cursor, jobs


def _decode_job(entry_id: bytes, fields: dict[bytes, bytes]) -> protocol.GenerateJob | None:
    try:
        job: protocol.GenerateJob = protocol.decode(fields[_FIELD], protocol.GenerateJob)
        return job
    except (KeyError, msgspec.DecodeError, protocol.ProtocolVersionError) as e:
        logger.error("undecodable job entry=%s: %s", entry_id, e)
        return None


def ack(pipe: aioredis.client.Pipeline, keys: Keys, entry_id: bytes) -> None:
    """Queue XACK + XDEL of a finished job on `pipe`."""
    pipe.xack(keys.request_stream, SCHEDULER_GROUP, entry_id)
    pipe.xdel(keys.request_stream, entry_id)


def dead_letter(
    pipe: aioredis.client.Pipeline, keys: Keys, job: protocol.GenerateJob, reason: str, n: int
) -> None:
    """Queue the copy of `job` to the dead-letter stream (before its ack: a crash in between
    can only duplicate a dead letter, never lose one)."""
    fields = {_FIELD: protocol.encode(job), b"rid": job.rid, b"reason": reason, b"deliveries": n}
    pipe.xadd(keys.dead_letters, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)  # type: ignore[arg-type]


async def dead_letters(r: aioredis.Redis, keys: Keys) -> list[tuple[bytes, dict[str, str]]]:
    """The dead letters, oldest first: (entry id, {rid, reason, deliveries})."""
    out = []
    for entry_id, fields in await r.xrange(keys.dead_letters):
        info = {k.decode(): v.decode() for k, v in fields.items() if k != _FIELD}
        out.append((entry_id, info))
    return out


async def retry_dead_letter(r: aioredis.Redis, keys: Keys, rid: str) -> bool:
    """Put `rid`'s dead letter back on the request stream (its output starts over) and drop
    it from the dead letters; False if there is none."""
    for entry_id, fields in await r.xrange(keys.dead_letters):
        if fields.get(b"rid", b"").decode() != rid:
            continue
        job: protocol.GenerateJob = protocol.decode(fields[_FIELD], protocol.GenerateJob)
        async with r.pipeline(transaction=True) as pipe:
            request_state.requeue(pipe, keys, rid)
            submit(pipe, keys, job)
            pipe.xdel(keys.dead_letters, entry_id)
            await pipe.execute()
        return True
    return False


async def purge_dead_letters(r: aioredis.Redis, keys: Keys) -> int:
    """Delete every dead letter; returns how many there were."""
    n: int = await r.xlen(keys.dead_letters)
    await r.delete(keys.dead_letters)
    return n
