"""The only module that issues commands on the request stream (`req`, group `schedulers`).

The api submits GenerateJob entries; schedulers read them through the consumer group,
only as many as they have room for, and ack each one after its request finished.
"""

from __future__ import annotations

import logging

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import protocol
from shared.keys import REQUEST_STREAM_MAXLEN, SCHEDULER_GROUP, Keys

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
