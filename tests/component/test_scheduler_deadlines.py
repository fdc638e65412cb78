"""Deadlines through the scheduler loop on fakeredis (a scripted runner, the core's clock in
the test's hands): a job past its deadline when taken from the stream ends at once, and a
running one ends at the first step past it, both with the 504 abort and their ack."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from shared import protocol, request_state, request_stream
from shared.config import SchedulerSettings, Settings
from shared.keys import Keys
from tests.support.scheduler_loop import VOCAB, ScriptedRunner, entries_of, received, subscribe
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.loop import SchedulerLoop

CREATED = 1_000_000.0


class Clock:
    now = CREATED

    def __call__(self) -> float:
        return self.now


def make_loop(r: aioredis.Redis, keys: Keys, clock: Clock) -> SchedulerLoop:
    config = SchedulerConfig(num_kv_blocks=32, vocab_size=VOCAB, max_model_len=64, block_size=4)
    core = Scheduler(config, decode_tail=lambda ids: "", clock=clock)
    settings = Settings(scheduler=SchedulerSettings(worker_id="w1", idle_block_ms=5))
    return SchedulerLoop(r, keys, settings, core, ScriptedRunner())


async def submit(r: aioredis.Redis, keys: Keys, rid: str, timeout_s: float, **extra: Any) -> None:
    job = protocol.GenerateJob(
        rid=rid, input_ids=[10, 11, 12],
        sampling=protocol.SamplingParams(max_new_tokens=40, ignore_eos=True),
        detok=protocol.DetokParams(api_id="api-1"), created_at=CREATED,
        deadline=CREATED + timeout_s, **extra,
    )  # fmt: skip
    async with r.pipeline() as pipe:
        request_stream.submit(pipe, keys, job)
        await pipe.execute()


TIMED_OUT = protocol.FinishReason(
    type="abort", message="The request exceeded its timeout of 2 s.", status_code=504
)


async def test_a_job_past_its_deadline_ends_when_a_scheduler_takes_it(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    clock = Clock()
    clock.now = CREATED + 3  # it waited in the stream longer than its timeout
    loop = make_loop(fake_redis, keys, clock)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "late", 2)
    await submit(fake_redis, keys, "fine", 10)
    await loop.run(burst=True)
    entries = entries_of(await received(pubsub), "late")
    assert [(e.token_ids, e.finish) for e in entries] == [([], TIMED_OUT)]
    state = await request_state.get(fake_redis, keys, "late")
    assert state["status"] == "aborted"
    assert await fake_redis.xlen(keys.request_stream) == 0  # acked: nothing left to redo


async def test_a_running_request_ends_at_the_first_step_past_its_deadline(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    clock = Clock()
    loop = make_loop(fake_redis, keys, clock)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "slow", 2)
    for _ in range(3):
        await loop.run_once()
    clock.now = CREATED + 2
    await loop.run_once()
    entries = entries_of(await received(pubsub), "slow")
    assert [len(e.token_ids) for e in entries[:3]] == [1, 1, 1]
    assert entries[-1].finish == TIMED_OUT and len(entries) == 4
    assert loop.core.is_idle and loop.core.block_manager.num_free_blocks == 32
    assert (await request_state.get(fake_redis, keys, "slow"))["status"] == "aborted"
    assert await fake_redis.xlen(keys.request_stream) == 0
