"""The commands on the request streams (one per priority band, group `schedulers`) and
their dead letters.

The api submits GenerateJob entries to their priority's band; schedulers read them through
the consumer group, highest band first and only as many as they have room for, take over
those of dead schedulers (`reclaim`), and ack each one after its request finished (in
shared.ownership's fenced step script). A job delivered too often is moved to the
dead-letter stream (`dead_letter`), which `redserve dlq` manages.

With several stream shards (Keys.stream_shards; a job goes to its rid's shard, whose hash
tag its request's keys share), a read asks every shard at once in one pipeline, the count
shared out from a random shard on (so every shard gets the larger share equally often), and
a reclaim walks the shards from a random one; no script spans two shards (on Redis Cluster
they live in different slots).

An entry is named by its ref: the stream entry id, prefixed with `band/` outside the default
band and `band@shard/` outside shard 0 (so ids of different streams never mix); `locate`
turns a ref back into stream + id.
"""

from __future__ import annotations

import logging
import random
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
from shared.redis_conn import atomic, eval_script

logger = logging.getLogger(__name__)

_FIELD = b"job"

Job = tuple[bytes, protocol.GenerateJob | None]  # entry ref, job (None: undecodable)
Cursors = dict[str, bytes]  # request stream -> XAUTOCLAIM cursor


def ref(band: str, entry_id: bytes, shard: int = 0) -> bytes:
    lane = f"{band}@{shard}" if shard else band
    return lane.encode() + b"/" + entry_id if lane else entry_id


def locate(keys: Keys, entry_ref: bytes) -> tuple[str, bytes]:
    """The stream and the entry id an entry ref names."""
    lane, _, entry_id = entry_ref.rpartition(b"/")
    band, _, shard = lane.decode().partition("@")
    return keys.request_stream_of(band, int(shard or 0)), entry_id


def _shards_from_random(keys: Keys) -> list[int]:
    """Every shard once, starting at a random one (fair reads without shared state)."""
    first = random.randrange(keys.stream_shards)
    return [(first + i) % keys.stream_shards for i in range(keys.stream_shards)]


class LayoutMismatch(RuntimeError):
    """This process's --stream-shards differs from the fleet's."""


async def check_layout(r: aioredis.Redis, keys: Keys) -> None:
    """Record the fleet's stream shard count, or raise LayoutMismatch when it differs from
    this process's: an api and a scheduler that disagree strand jobs on unread shards."""
    await r.set(keys.stream_layout, keys.stream_shards, nx=True)
    held = await r.get(keys.stream_layout)
    if held is not None and int(held) != keys.stream_shards:
        raise LayoutMismatch(
            f"this fleet runs {int(held)} request stream shard(s) (Redis key"
            f" {keys.stream_layout}) but this process has --stream-shards {keys.stream_shards};"
            " give every process the same count (to change it: stop the whole fleet, then"
            " delete that key)"
        )


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
        keys.request_stream_of(band_of(job.priority), keys.shard(job.rid)),
        {_FIELD: protocol.encode(job)},
        maxlen=REQUEST_STREAM_MAXLEN,
        approximate=True,
    )


async def read(
    r: aioredis.Redis, keys: Keys, consumer: str, count: int, block_ms: int | None
) -> list[Job]:
    """Read up to `count` new jobs for `consumer`, in each shard from the highest band down;
    when nothing was found and `block_ms` is set, one shard's default band is read blocking,
    for `block_ms` split over the shards (so an idle scheduler comes back to the others that
    often). Undecodable entries come back as None so the caller can ack them (a bad job must
    not be redelivered forever)."""
    shards = _shards_from_random(keys)
    if block_ms is not None and keys.stream_shards == 1:  # its bands in turn, then blocking
        return await _read_shard(r, keys, shards[0], consumer, count, block_ms)
    out = await _read_shards(r, keys, shards, consumer, count)
    if not out and block_ms is not None:
        block_ms = max(1, block_ms // keys.stream_shards)
        out += await _read_band(r, keys, "", shards[0], consumer, count, block_ms)
    return out


async def _read_shards(
    r: aioredis.Redis, keys: Keys, shards: list[int], consumer: str, count: int
) -> list[Job]:
    """Every shard's bands at once (one pipeline; on a cluster, the nodes in parallel), the
    count shared out over the shards; again over the shards that filled their share, until
    `count` is reached or they are empty."""
    out: list[Job] = []
    while shards and len(out) < count:
        left = count - len(out)
        shares = {shard: left // len(shards) + (i < left % len(shards))
                  for i, shard in enumerate(shards)}  # fmt: skip
        asked = [shard for shard in shards if shares[shard]]
        pipe = r.pipeline(transaction=False)
        for shard in asked:
            streams = keys.shard_streams(shard)
            eval_script(pipe, _READ_BANDS, streams, [SCHEDULER_GROUP, consumer, shares[shard]])
        replies = await _in_group(r, keys, pipe.execute())
        if replies is None:
            return out
        got = {shard: _band_jobs(shard, reply) for shard, reply in zip(asked, replies, strict=True)}
        out += [job for jobs in got.values() for job in jobs]
        # A shard that filled its share may hold more; one not asked yet is asked next time.
        shards = [shard for shard in shards if len(got.get(shard, ())) == shares[shard]]
    return out


async def _read_shard(
    r: aioredis.Redis, keys: Keys, shard: int, consumer: str, count: int, block_ms: int
) -> list[Job]:
    out: list[Job] = []
    for band in PRIORITY_BANDS:
        if len(out) >= count:
            break
        block = block_ms if band == "" and not out else None
        out += await _read_band(r, keys, band, shard, consumer, count - len(out), block)
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


def _band_jobs(shard: int, reply: Any) -> list[Job]:
    """The jobs of one shard's _READ_BANDS reply."""
    return [
        (ref(PRIORITY_BANDS[int(i) - 1], entry_id, shard), _decode_job(entry_id, _pairs(fields)))
        for i, entries in reply or []
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
    r: aioredis.Redis,
    keys: Keys,
    band: str,
    shard: int,
    consumer: str,
    count: int,
    block_ms: int | None,
) -> list[Job]:
    stream = keys.request_stream_of(band, shard)
    read = r.xreadgroup(SCHEDULER_GROUP, consumer, {stream: ">"}, count=count, block=block_ms)
    resp = await _in_group(r, keys, read)
    return [
        (ref(band, entry_id, shard), _decode_job(entry_id, fields))
        for _stream, entries in resp or []
        for entry_id, fields in entries
    ]


async def reclaim(
    r: aioredis.Redis, keys: Keys, consumer: str, min_idle_ms: int, count: int, cursors: Cursors
) -> list[Job]:
    """XAUTOCLAIM up to `count` entries idle at least `min_idle_ms` (their owner stopped
    renewing them: dead or frozen), highest band first, each band from its cursor on
    (`cursors` is advanced), the shards from a random one."""
    jobs: list[Job] = []
    lanes = [(shard, band) for shard in _shards_from_random(keys) for band in PRIORITY_BANDS]
    for shard, band in lanes:
        if len(jobs) >= count:
            break
        stream = keys.request_stream_of(band, shard)
        cursor = cursors.get(stream, b"0-0")
        try:
            resp = await r.xautoclaim(stream, SCHEDULER_GROUP, consumer, min_idle_ms, cursor,
                                      count=count - len(jobs))  # fmt: skip
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await ensure_group(r, keys)
            cursors.clear()
            return jobs
        cursors[stream] = resp[0]
        jobs += [(ref(band, e, shard), _decode_job(e, fields)) for e, fields in resp[1] if fields]
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
        async with atomic(r) as pipe:
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
