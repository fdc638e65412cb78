"""`redserve jobs`: the jobs tier, an arq worker. It runs OpenAI Batch API batches
(`run_batch`: workers.batch.runner) and the maintenance crons (workers.maintenance).

arq's jobs are msgpack (shared.job_queue), in the queue `keys.jobs_queue`. A batch's job
takes the batch's lease before it waits for one of this worker's `jobs.max_batches` slots,
so the recovery never mistakes a queued run for a dead one. The worker beats like every
tier (`worker:jobs:{id}`: `redserve health jobs`); its batch lines go through an api app of
its own (workers.batch.fleet_client)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from typing import Any

from arq.connections import ArqRedis
from arq.worker import Worker, func
from redis.asyncio import ConnectionPool

from shared import batches, heartbeat, job_queue
from shared.config import Settings, get_settings
from shared.heartbeat import JOBS, Beat
from shared.keys import HEARTBEAT_EVERY_S
from shared.logging_setup import configure_logging
from shared.redis_conn import connect
from workers import maintenance
from workers.batch.fleet_client import FleetClient
from workers.batch.lease import batch_lease
from workers.batch.runner import BatchRun, Superseded

logger = logging.getLogger("workers.jobs")

# A batch's job may run as long as its completion window, and then some.
BATCH_JOB_TIMEOUT_S = 26 * 3600


async def run_batch(ctx: dict[str, Any], batch_id: str, attempt: int) -> str:
    """Run one batch to its end (or to a cancel, an expiry, a lost lease)."""
    settings: Settings = ctx["settings"]
    redis = ctx["redis"]
    keys = settings.redis_keys()
    record = await batches.get(redis, keys, batch_id)
    if record is None or record.status in batches.TERMINAL or record.attempt != attempt:
        return "stale"
    async with batch_lease(redis, keys, batch_id) as held:
        if not held:
            return "held by another run"
        async with ctx["batch_slots"]:
            record = await batches.get(redis, keys, batch_id)
            if record is None or record.attempt != attempt:
                return "stale"
            try:
                return await BatchRun(settings, redis, ctx["client"], record).run()
            except Superseded:
                return "superseded"


async def _beat(settings: Settings, redis: Any) -> None:
    keys = settings.redis_keys()
    while True:
        with contextlib.suppress(Exception):
            async with redis.pipeline(transaction=False) as pipe:
                heartbeat.beat(pipe, keys, settings.jobs.worker_id, Beat(), kind=JOBS)
                await pipe.execute()
        await asyncio.sleep(HEARTBEAT_EVERY_S)


async def startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    redis = connect(settings.redis_url, settings.redis_cluster)
    client = FleetClient(settings, redis)
    await client.start()
    ctx.update(redis=redis, client=client, batch_slots=asyncio.Semaphore(settings.jobs.max_batches))
    ctx[maintenance.LEASELESS] = set()
    ctx["beat"] = asyncio.create_task(_beat(settings, redis))
    logger.info("jobs worker %s ready", settings.jobs.worker_id)


async def shutdown(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    if "beat" in ctx:
        ctx["beat"].cancel()
    redis = ctx.get("redis")
    if redis is None:
        return
    with contextlib.suppress(Exception):
        async with redis.pipeline(transaction=False) as pipe:
            heartbeat.forget(pipe, settings.redis_keys(), settings.jobs.worker_id, JOBS)
            await pipe.execute()
    await ctx["client"].close()
    await redis.aclose()


def build_worker(settings: Settings, *, burst: bool = False) -> Worker:
    """The arq worker (constructs, connects nothing)."""
    keys = settings.redis_keys()
    pool = ArqRedis(
        ConnectionPool.from_url(settings.redis_url),
        job_serializer=job_queue.serialize,
        job_deserializer=job_queue.deserialize,
        default_queue_name=keys.jobs_queue,
    )
    crons = maintenance.cron_jobs(keys)
    return Worker(
        functions=[func(run_batch, name=job_queue.RUN_BATCH, timeout=BATCH_JOB_TIMEOUT_S)],
        cron_jobs=crons,
        redis_pool=pool,
        queue_name=keys.jobs_queue,
        health_check_key=f"{keys.jobs_queue}:health-check",
        job_serializer=job_queue.serialize,
        job_deserializer=job_queue.deserialize,
        # Batches wait on their own slots (batch_slots): room for them and every cron.
        max_jobs=settings.jobs.max_batches + len(crons) + 1,
        on_startup=startup,
        on_shutdown=shutdown,
        ctx={"settings": settings},
        burst=burst,
        keep_result=3600,
    )


def main(settings: Settings) -> None:
    configure_logging(settings.log_level, "jobs")
    # One line per line sent, and two per cron tick, would drown the batches' own logs.
    for noisy in ("httpx", "arq.worker"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.root.level))
    if not settings.redis_url:
        logger.error("the jobs tier needs a Redis: set REDSERVE_REDIS_URL or --redis-url")
        sys.exit(2)
    if settings.redis_cluster:
        logger.error("the jobs tier (arq) needs a single Redis, not a Redis Cluster")
        sys.exit(2)
    try:
        build_worker(settings).run()
    except Exception:
        logger.exception("jobs worker failed")
        sys.exit(1)


if __name__ == "__main__":
    main(get_settings())
