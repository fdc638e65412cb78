"""The only module that writes or reads worker heartbeats (`worker:{kind}:{id}` hashes).

A worker refreshes its hash every step that changed its batch and at least every
HEARTBEAT_EVERY_S; the key expires HEARTBEAT_TTL_S after the last beat, so a key that exists
is a live worker. Health checks and (later) reclaim and metrics read them here.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec
import redis.asyncio as aioredis

from shared.keys import HEARTBEAT_TTL_S, Keys

WorkerKind = Literal["scheduler", "api", "detokenizer"]
SCHEDULER: WorkerKind = "scheduler"
API: WorkerKind = "api"
DETOKENIZER: WorkerKind = "detokenizer"


class SchedulerBeat(msgspec.Struct, frozen=True):
    """What a scheduler reports with each beat (its batch and its KV cache)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    updated_at: float = 0.0


class Beat(msgspec.Struct, frozen=True):
    """The beat of a worker that reports nothing but being alive (api, detokenizer)."""

    updated_at: float = 0.0


def beat(
    pipe: aioredis.client.Pipeline,
    keys: Keys,
    worker_id: str,
    fields: SchedulerBeat | Beat,
    kind: WorkerKind = SCHEDULER,
) -> None:
    """Queue the beat: the hash (stamped now) and its expiry."""
    key = keys.heartbeat(kind, worker_id)
    stamped = msgspec.structs.replace(fields, updated_at=time.time())
    pipe.hset(key, mapping=msgspec.structs.asdict(stamped))
    pipe.expire(key, HEARTBEAT_TTL_S)


async def remove(r: aioredis.Redis, keys: Keys, worker_id: str, kind: WorkerKind) -> None:
    """Forget a worker that stops cleanly (so nobody waits for its beat to expire)."""
    await r.delete(keys.heartbeat(kind, worker_id))


def forget(
    pipe: aioredis.client.Pipeline, keys: Keys, worker_id: str, kind: WorkerKind = SCHEDULER
) -> None:
    """Queue the deletion of a worker's beat: a clean stop is seen at once, not a TTL later."""
    pipe.delete(keys.heartbeat(kind, worker_id))


async def read(r: aioredis.Redis, keys: Keys, worker_id: str) -> SchedulerBeat | None:
    """A scheduler's last beat, or None once it expired (or never beat)."""
    raw: dict[bytes, bytes] = await r.hgetall(keys.heartbeat(SCHEDULER, worker_id))  # type: ignore[misc]
    if not raw:
        return None
    data = {k.decode(): v.decode() for k, v in raw.items()}
    return msgspec.convert(data, SchedulerBeat, strict=False)


async def live_workers(
    r: aioredis.Redis, keys: Keys, kind: WorkerKind, prefix: str = ""
) -> list[str]:
    """Ids of the workers of `kind` (whose id starts with `prefix`) with a fresh beat."""
    pattern = keys.heartbeat(kind, f"{prefix}*")
    found = [key async for key in r.scan_iter(match=pattern, count=100)]
    head = len(keys.heartbeat(kind, ""))
    return [(k.decode() if isinstance(k, bytes) else k)[head:] for k in found]
