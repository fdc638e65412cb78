"""A batch's record (OpenAI's Batch object) in Redis: the `batch:{id}` hash, one JSON value
per field, so that the counts go up in place (HINCRBY) and the status moves by compare-and-set
(`transition`). Batches are listed by creation time (`batches`); unfinished ones are also in
`batches:active`, where the maintenance job looks for batches to recover or expire.

Statuses: validating -> in_progress -> finalizing -> completed, or failed | expired, or
(cancel) cancelling -> cancelled."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared.keys import BATCH_KEEP_S, Keys
from shared.redis_conn import atomic

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# Where each status may be reached from.
SOURCES: dict[str, tuple[str, ...]] = {
    "in_progress": ("validating",),
    "finalizing": ("in_progress",),
    "completed": ("finalizing",),
    "failed": ("validating", "in_progress", "finalizing"),
    "expired": ("validating", "in_progress", "finalizing"),
    "cancelling": ("validating", "in_progress", "finalizing"),
    "cancelled": ("cancelling",),
}
COUNTS = ("total", "completed", "failed")
# SGLang's and OpenAI's only window.
COMPLETION_WINDOWS = {"24h": 86400}


class BatchRecord(msgspec.Struct, kw_only=True):
    """OpenAI's Batch object, field for field (`request_counts` kept as three fields)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    attempt: int = 0  # the run of the jobs tier that owns it (bumped when it is recovered)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0

    def to_api(self) -> dict[str, Any]:
        out = msgspec.structs.asdict(self)
        counts = {name: out.pop(name) for name in COUNTS}
        out.pop("attempt")
        return {"object": "batch", **out, "request_counts": counts}


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def _encode(record: BatchRecord) -> dict[str, str]:
    return {k: msgspec.json.encode(v).decode() for k, v in msgspec.structs.asdict(record).items()}


def _decode(stored: dict[Any, Any]) -> BatchRecord:
    fields = {_text(k): msgspec.json.decode(_text(v)) for k, v in stored.items()}
    return msgspec.convert(fields, BatchRecord)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def create(r: aioredis.Redis, keys: Keys, record: BatchRecord) -> None:
    async with atomic(r) as pipe:
        pipe.hset(keys.batch(record.id), mapping=_encode(record))
        # Listed by the time to the microsecond: created_at (seconds) ties within a second.
        pipe.zadd(keys.batches, {record.id: time.time()})
        pipe.sadd(keys.active_batches, record.id)
        await pipe.execute()


async def get(r: aioredis.Redis, keys: Keys, batch_id: str) -> BatchRecord | None:
    stored = await r.hgetall(keys.batch(batch_id))  # type: ignore[misc]
    return _decode(stored) if stored else None


async def get_many(r: aioredis.Redis, keys: Keys, batch_ids: list[str]) -> list[BatchRecord]:
    async with r.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.hgetall(keys.batch(batch_id))
        stored = await pipe.execute()
    return [_decode(s) for s in stored if s]


async def page(
    r: aioredis.Redis, keys: Keys, after: str | None, limit: int
) -> tuple[list[BatchRecord], bool]:
    """Newest first, the batches after `after` (OpenAI's cursor), and whether more follow."""
    ids = [_text(i) for i in await r.zrange(keys.batches, 0, -1, desc=True)]
    if after is not None:
        ids = ids[ids.index(after) + 1 :] if after in ids else []
    return await get_many(r, keys, ids[:limit]), len(ids) > limit


# Status CAS. ARGV: the new status, the statuses it may come from (comma-joined), the batch
# id, the record's TTL once terminal ("0": not terminal), then field/value pairs to set with
# it. Returns the status found (unchanged when refused), nil when there is no such batch.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
local found = cjson.decode(current)
for allowed in string.gmatch(ARGV[2], '[^,]+') do
  if allowed == found then
    redis.call('HSET', KEYS[1], 'status', cjson.encode(ARGV[1]))
    for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    if ARGV[4] ~= '0' then
      redis.call('SREM', KEYS[2], ARGV[3])
      redis.call('EXPIRE', KEYS[1], ARGV[4])
    end
    return current
  end
end
return current
"""


async def transition(
    r: aioredis.Redis, keys: Keys, batch_id: str, status: str, **fields: Any
) -> str | None:
    """Move the batch to `status` (stamping `{status}_at`) if its current status may lead
    there (SOURCES); returns the status it had (None: no such batch). The caller compares it
    with SOURCES to know whether it moved."""
    values = {f"{status}_at": int(time.time()), **fields}
    ttl = BATCH_KEEP_S if status in TERMINAL else 0
    argv: list[str] = [status, ",".join(SOURCES[status]), batch_id, str(ttl)]
    for name, value in values.items():
        argv += [name, msgspec.json.encode(value).decode()]
    found = await r.eval(_TRANSITION, 2, keys.batch(batch_id), keys.active_batches, *argv)  # type: ignore[misc]
    return None if found is None else str(msgspec.json.decode(_text(found)))


def moved(found: str | None, status: str) -> bool:
    return found is not None and found in SOURCES[status]


def count(pipe: aioredis.client.Pipeline, keys: Keys, batch_id: str, outcome: str) -> None:
    """One line more `completed` or `failed`."""
    pipe.hincrby(keys.batch(batch_id), outcome, 1)


async def set_fields(r: aioredis.Redis, keys: Keys, batch_id: str, **fields: Any) -> None:
    mapping = {k: msgspec.json.encode(v).decode() for k, v in fields.items()}
    await r.hset(keys.batch(batch_id), mapping=mapping)  # type: ignore[misc]


async def active(r: aioredis.Redis, keys: Keys) -> list[str]:
    return sorted(_text(i) for i in await r.smembers(keys.active_batches))  # type: ignore[misc]
