"""The jobs tier's arq queue, as the api and the maintenance job enqueue into it.

arq pickles by default; its jobs are msgpack here (msgspec), so nothing read from Redis is ever
unpickled. The queue is `keys.jobs_queue` and every job id starts with the key prefix, so two
deployments sharing a Redis under different prefixes do not take each other's jobs."""

from __future__ import annotations

from typing import Any

import msgspec
import redis.asyncio as aioredis
from arq.connections import ArqRedis

from shared.keys import Keys

RUN_BATCH = "run_batch"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def serialize(value: dict[str, Any]) -> bytes:
    return _encoder.encode(value)


def deserialize(data: bytes) -> dict[str, Any]:
    value: dict[str, Any] = _decoder.decode(data)
    return value


def batch_job_id(keys: Keys, batch_id: str, attempt: int) -> str:
    return f"{keys.prefix}:batch:{batch_id}:{attempt}"


def arq_client(r: aioredis.Redis, keys: Keys) -> ArqRedis:
    """An arq client over `r`'s connection pool (closing it leaves the pool to `r`)."""
    return ArqRedis(
        r.connection_pool,
        job_serializer=serialize,
        job_deserializer=deserialize,
        default_queue_name=keys.jobs_queue,
    )


async def enqueue_batch(r: aioredis.Redis, keys: Keys, batch_id: str, attempt: int) -> bool:
    """Queue run `attempt` of a batch; False if that run was queued already."""
    job = await arq_client(r, keys).enqueue_job(
        RUN_BATCH, batch_id, attempt, _job_id=batch_job_id(keys, batch_id, attempt)
    )
    return job is not None
