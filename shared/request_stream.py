"""The commands on the request streams (one per priority band, group `schedulers`) and
their dead letters.

The api submits GenerateJob entries to their priority's band; schedulers read them through
the consumer group, highest band first and only as many as they have room for, take over
those of dead schedulers (`reclaim`), and ack each one after its request finished (in
shared.ownership's fenced step script). A job delivered too often is moved to the
dead-letter stream (`dead_letter`), which `redserve dlq` manages.

An entry is named by its ref: the stream entry id, prefixed with `band/` outside the default
band (so ids of different streams never mix); `locate` turns a ref back into stream + id.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import protocol, request_state
from shared.keys import (
    DEAD_LETTER_MAXLEN,
    PRIORITY_BANDS,
    REQUEST_STREAM_MAXLEN,
    SCHEDULER_GROUP,
    Keys,
    band_of,
)

logger = logging.getLogger(__name__)

_FIELD = b"job"

Job = tuple[bytes, protocol.GenerateJob | None]  # entry ref, job (None: undecodable)
Cursors = dict[str, bytes]  # band -> XAUTOCLAIM cursor


def ref(band: str, entry_id: bytes) -> bytes:
    return band.encode() + b"/" + entry_id if band else entry_id


def locate(keys: Keys, entry_ref: bytes) -> tuple[str, bytes]:
    """The stream and the entry id an entry ref names."""
    band, _, entry_id = entry_ref.rpartition(b"/")
    return keys.request_stream_of(band.decode()), entry_id


async def ensure_group(r: aioredis.Redis, keys: Keys) -> None:
    """Create the consumer group (and the streams) if missing; Redis restarts drop them."""
    for stream in keys.request_streams:
        try:
            await r.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def submit(pipe: aioredis.client.Pipeline, keys: Keys, job: protocol.GenerateJob) -> None:
    """Queue XADD of `job` to its priority band's stream on `pipe` (the caller executes)."""
    pipe.xadd(
        keys.request_stream_of(band_of(job.priority)),
        {_FIELD: protocol.encode(job)},
        maxlen=REQUEST_STREAM_MAXLEN,
        approximate=True,
    )


async def read(
    r: aioredis.Redis, keys: Keys, consumer: str, count: int, block_ms: int | None
) -> list[Job]:
    """Read up to `count` new jobs for `consumer`, from the highest band down; only the
    default band's read blocks (for `block_ms`), and only when the high band had none.
    Undecodable entries come back as None so the caller can ack them (a bad job must not
    be redelivered forever)."""
    if block_ms is None:  # busy: every band in one round trip
        return await _read_bands(r, keys, consumer, count)
    out: list[Job] = []
    for band in PRIORITY_BANDS:
        if len(out) >= count:
            break
        block = block_ms if band == "" and not out else None
        out += await _read_band(r, keys, band, consumer, count - len(out), block)
    return out


# KEYS: the band streams, highest first. ARGV: group, consumer, count. XREADGROUP on each
# band in turn until `count` entries were read; the replies, one per band that had any.
_READ_BANDS = """
local left = tonumber(ARGV[3])
local out = {}
for i = 1, #KEYS do
  if left <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left,
                         'STREAMS', KEYS[i], '>')
  if got then
    local entries = got[1][2]
    left = left - #entries
    table.insert(out, {i, entries})
  end
end
return out
"""


async def _read_bands(r: aioredis.Redis, keys: Keys, consumer: str, count: int) -> list[Job]:
    streams = [keys.request_stream_of(band) for band in PRIORITY_BANDS]
    script = r.register_script(_READ_BANDS)
    args: list[str | int] = [SCHEDULER_GROUP, consumer, count]
    replies = await _in_group(r, keys, script(keys=streams, args=args))
    return [
        (ref(PRIORITY_BANDS[int(i) - 1], entry_id), _decode_job(entry_id, _pairs(fields)))
        for i, entries in replies or []
        for entry_id, fields in entries
    ]


async def _in_group(r: aioredis.Redis, keys: Keys, read: Awaitable[Any]) -> Any:
    """`read`'s reply; None once the group a Redis restart dropped is made again."""
    try:
        return await read
    except ResponseError as e:
        if "NOGROUP" not in str(e):
            raise
        await ensure_group(r, keys)
        return None


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


async def _read_band(
    r: aioredis.Redis, keys: Keys, band: str, consumer: str, count: int, block_ms: int | None
) -> list[Job]:
    stream = keys.request_stream_of(band)
    read = r.xreadgroup(SCHEDULER_GROUP, consumer, {stream: ">"}, count=count, block=block_ms)
    resp = await _in_group(r, keys, read)
    return [
        (ref(band, entry_id), _decode_job(entry_id, fields))
        for _stream, entries in resp or []
        for entry_id, fields in entries
    ]


async def reclaim(
    r: aioredis.Redis, keys: Keys, consumer: str, min_idle_ms: int, count: int, cursors: Cursors
) -> list[Job]:
    """XAUTOCLAIM up to `count` entries idle at least `min_idle_ms` (their owner stopped
    renewing them: dead or frozen), highest band first, each band from its cursor on
    (`cursors` is advanced)."""
    jobs: list[Job] = []
    for band in PRIORITY_BANDS:
        if len(jobs) >= count:
            break
        stream, cursor = keys.request_stream_of(band), cursors.get(band, b"0-0")
        try:
            resp = await r.xautoclaim(stream, SCHEDULER_GROUP, consumer, min_idle_ms, cursor,
                                      count=count - len(jobs))  # fmt: skip
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await ensure_group(r, keys)
            cursors.clear()
            return jobs
        cursors[band] = resp[0]
        jobs += [(ref(band, e), _decode_job(e, fields)) for e, fields in resp[1] if fields]
    return jobs


def _decode_job(entry_id: bytes, fields: dict[bytes, bytes]) -> protocol.GenerateJob | None:
    try:
        job: protocol.GenerateJob = protocol.decode(fields[_FIELD], protocol.GenerateJob)
        return job
    except (KeyError, msgspec.DecodeError, protocol.ProtocolVersionError) as e:
        logger.error("undecodable job entry=%s: %s", entry_id, e)
        return None


def ack(pipe: aioredis.client.Pipeline, keys: Keys, entry_ref: bytes) -> None:
    """Queue XACK + XDEL of a finished job on `pipe`."""
    stream, entry_id = locate(keys, entry_ref)
    pipe.xack(stream, SCHEDULER_GROUP, entry_id)
    pipe.xdel(stream, entry_id)


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
