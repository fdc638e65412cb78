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

# Registry entries older than this are pruned (and the registry expires if nobody beats).
_REGISTRY_KEEP_S = 6 * HEARTBEAT_TTL_S

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
    """Queue the beat: the hash (stamped now) and its expiry, and the worker's place in its
    kind's registry."""
    key = keys.heartbeat(kind, worker_id)
    now = time.time()
    stamped = msgspec.structs.replace(fields, updated_at=now)
    pipe.hset(key, mapping=msgspec.structs.asdict(stamped))
    pipe.expire(key, HEARTBEAT_TTL_S)
    registry = keys.worker_registry(kind)
    pipe.zadd(registry, {worker_id: now})
    pipe.zremrangebyscore(registry, "-inf", now - _REGISTRY_KEEP_S)
    pipe.expire(registry, int(_REGISTRY_KEEP_S))


def forget(
    pipe: aioredis.client.Pipeline, keys: Keys, worker_id: str, kind: WorkerKind = SCHEDULER
) -> None:
    """Queue the deletion of a worker's beat: a clean stop is seen at once, not a TTL later."""
    pipe.delete(keys.heartbeat(kind, worker_id))
    pipe.zrem(keys.worker_registry(kind), worker_id)


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
    """Ids of the workers of `kind` (whose id starts with `prefix`) with a fresh beat: those
    the registry lists as recent whose beat key still exists."""
    since = time.time() - HEARTBEAT_TTL_S - 1
    listed = await r.zrangebyscore(keys.worker_registry(kind), since, "+inf")
    ids = [(w.decode() if isinstance(w, bytes) else w) for w in listed]
    ids = [w for w in ids if w.startswith(prefix)]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.exists(keys.heartbeat(kind, worker_id))
    return [w for w, alive in zip(ids, await pipe.execute(), strict=True) if alive]
