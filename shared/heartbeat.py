"""The only module that writes or reads worker heartbeats (`worker:{kind}:{id}` hashes).

A worker refreshes its hash every step that changed its batch and at least every
HEARTBEAT_EVERY_S; the key expires HEARTBEAT_TTL_S after the last beat, so a key that exists
is a live worker. Health checks, reclaim, admission, metrics and `redserve status` read them
here (`live_beats`: every live worker of a kind with its figures). The pipelines may be
asyncio ones or, for a beat sent from a thread (a scheduler loading its model), plain ones.
"""

from __future__ import annotations

import time
from typing import Literal, TypeVar

import msgspec
import redis
import redis.asyncio as aioredis

from shared.keys import HEARTBEAT_TTL_S, Keys

# Registry entries older than this are pruned (and the registry expires if nobody beats).
_REGISTRY_KEEP_S = 6 * HEARTBEAT_TTL_S

WorkerKind = Literal["scheduler", "api", "detokenizer", "jobs"]
SchedulerState = Literal["loading", "ready", "paused", "updating", "draining"]
SERVING_STATES = ("ready", "paused")
SCHEDULER: WorkerKind = "scheduler"
API: WorkerKind = "api"
DETOKENIZER: WorkerKind = "detokenizer"
JOBS: WorkerKind = "jobs"


class SchedulerBeat(msgspec.Struct, frozen=True):
    """What a scheduler reports with each beat (its batch and its KV cache)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    updated_at: float = 0.0
    # loading (model, kernels: `progress` says which) | ready | paused | updating (weights)
    # | draining. Only a ready or paused scheduler has a model to serve with.
    state: str = "ready"
    progress: str = ""
    model_path: str = ""
    weight_version: str = ""
    gen_throughput: float = 0.0  # generated tokens per second, recent


class Beat(msgspec.Struct, frozen=True):
    """The beat of a worker that reports nothing but being alive (api)."""

    updated_at: float = 0.0


class DetokenizerBeat(msgspec.Struct, frozen=True):
    """What a detokenizer reports with each beat: the shards it serves, the requests it
    follows, and what it has done since it started (counters: they restart with it)."""

    shards: str = ""  # the token shards it holds leases on, comma-separated ("0,2")
    num_states: int = 0  # live per-request decode states
    num_batches: int = 0  # TokenBatches handled
    num_entries: int = 0  # TextEntries published
    updated_at: float = 0.0


AnyBeat = SchedulerBeat | DetokenizerBeat | Beat
BeatT = TypeVar("BeatT", SchedulerBeat, DetokenizerBeat, Beat)


def beat(
    pipe: aioredis.client.Pipeline | redis.client.Pipeline,
    keys: Keys,
    worker_id: str,
    fields: AnyBeat,
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
    pipe: aioredis.client.Pipeline | redis.client.Pipeline,
    keys: Keys,
    worker_id: str,
    kind: WorkerKind = SCHEDULER,
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


async def live_scheduler_beats(r: aioredis.Redis, keys: Keys) -> dict[str, SchedulerBeat]:
    """The last beat of every live scheduler (two round trips, whatever their number)."""
    return await live_beats(r, keys, SCHEDULER, SchedulerBeat)


async def live_beats(
    r: aioredis.Redis, keys: Keys, kind: WorkerKind, cls: type[BeatT]
) -> dict[str, BeatT]:
    """The last beat of every live worker of `kind`, as `cls` (two round trips, whatever
    their number): those the registry lists as recent whose beat key still exists."""
    since = time.time() - HEARTBEAT_TTL_S - 1
    ids = [_text(w) for w in await r.zrangebyscore(keys.worker_registry(kind), since, "+inf")]
    if not ids:
        return {}
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(keys.heartbeat(kind, worker_id))
    beats: dict[str, BeatT] = {}
    for worker_id, raw in zip(ids, await pipe.execute(), strict=True):
        if raw:  # it expired in between
            data = {_text(k): _text(v) for k, v in raw.items()}
            beats[worker_id] = msgspec.convert(data, cls, strict=False)
    return beats


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
