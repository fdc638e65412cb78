"""Driving the scheduler loop on a (fake) Redis: a scripted model runner, a loop around the
pure core, submitting jobs and reading the TokenBatches it publishes."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from shared import protocol, request_stream
from shared.config import SchedulerSettings, Settings
from shared.keys import SCHEDULER_GROUP, Keys
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.loop import SchedulerLoop

EOS = 2
VOCAB = 100
DEFAULT_TOKEN = 50


class ScriptedRunner:
    """Gives each request the next token of its script (then DEFAULT_TOKEN); records each
    step as {rid: new tokens computed}."""

    def __init__(self, scripts: dict[str, list[int]] | None = None) -> None:
        self.scripts = scripts or {}
        self.steps: list[dict[str, int]] = []

    def run(self, seqs: list[Sequence]) -> list[int]:
        self.steps.append({seq.rid: seq.num_new_tokens for seq in seqs})
        tokens = []
        for seq in [seq for seq in seqs if seq.will_sample]:
            script = self.scripts.get(seq.rid, [])
            n = seq.num_completion_tokens
            tokens.append(script[n] if n < len(script) else DEFAULT_TOKEN)
        return tokens


def make_loop(
    r: aioredis.Redis,
    keys: Keys,
    runner: ScriptedRunner,
    worker_id: str = "w1",
    scheduler: dict[str, Any] | None = None,
    **core: Any,
) -> SchedulerLoop:
    config: dict[str, Any] = dict(
        num_kv_blocks=32, vocab_size=VOCAB, max_model_len=64, block_size=4, max_num_seqs=8
    )
    pure_core = Scheduler(
        SchedulerConfig(**{**config, **core}, eos_token_ids=frozenset({EOS})),
        decode_tail=lambda ids: "".join(f"<{i}>" for i in ids),
    )
    sched = SchedulerSettings(worker_id=worker_id, idle_block_ms=5, **(scheduler or {}))
    settings = Settings(scheduler=sched)
    return SchedulerLoop(r, keys, settings, pure_core, runner)


async def submit(
    r: aioredis.Redis, keys: Keys, rid: str, prompt: list[int] | None = None, **sampling: Any
) -> None:
    job = protocol.GenerateJob(
        rid=rid,
        input_ids=prompt or [10, 11, 12],
        sampling=protocol.SamplingParams(**sampling),
        detok=protocol.DetokParams(api_id="api-1"),
    )
    pipe = r.pipeline()
    request_stream.submit(pipe, keys, job)
    await pipe.execute()


async def subscribe(r: aioredis.Redis, keys: Keys) -> aioredis.client.PubSub:
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.token_channel(0))
    return pubsub


async def received(pubsub: aioredis.client.PubSub) -> list[protocol.TokenBatch]:
    batches = []
    while msg := await pubsub.get_message(timeout=0.01):
        if msg["type"] == "message":
            batches.append(protocol.decode(msg["data"], protocol.TokenBatch))
    return batches


def entries_of(batches: list[protocol.TokenBatch], rid: str) -> list[protocol.TokenEntry]:
    return [e for b in batches for e in b.entries if e.rid == rid]


async def num_pending(r: aioredis.Redis, keys: Keys) -> int:
    info = await r.xpending(keys.request_stream, SCHEDULER_GROUP)
    return int(info["pending"])


async def pending(r: aioredis.Redis, keys: Keys) -> list[tuple[str, int, int]]:
    """(consumer, idle ms, deliveries) of each pending job, oldest first."""
    rows = await r.xpending_range(keys.request_stream, SCHEDULER_GROUP, "-", "+", 100)
    return [
        (row["consumer"].decode(), row["time_since_delivered"], row["times_delivered"])
        for row in rows
    ]


async def pending_entry(r: aioredis.Redis, keys: Keys) -> bytes:
    """The id of the oldest pending job."""
    rows = await r.xpending_range(keys.request_stream, SCHEDULER_GROUP, "-", "+", 1)
    return bytes(rows[0]["message_id"])


async def take_over(r: aioredis.Redis, keys: Keys, rid: str, consumer: str) -> None:
    """What another scheduler's reclaim does to the oldest pending job (`rid`'s): move it
    to `consumer` and bump the owner epoch."""
    entry_id = await pending_entry(r, keys)
    await r.xclaim(keys.request_stream, SCHEDULER_GROUP, consumer, 0, [entry_id])
    await r.hincrby(keys.state(rid), "epoch", 1)  # type: ignore[misc]


async def take_as(r: aioredis.Redis, keys: Keys, consumer: str) -> bytes:
    """Deliver the next job to `consumer` (a scheduler that then dies); its entry id."""
    await request_stream.ensure_group(r, keys)
    resp = await r.xreadgroup(SCHEDULER_GROUP, consumer, {keys.request_stream: ">"}, count=1)
    return bytes(resp[0][1][0][0])


async def make_idle(
    r: aioredis.Redis,
    keys: Keys,
    consumer: str,
    entry_id: bytes,
    deliveries: int | None = None,
    stream: str | None = None,
) -> None:
    """Age `consumer`'s entry (of `stream`, default the default one) past any reclaim time,
    as if its owner stopped renewing it a minute ago (optionally with a delivery count)."""
    await r.xclaim(stream or keys.request_stream, SCHEDULER_GROUP, consumer, 0, [entry_id],
                   idle=60_000, retrycount=deliveries, justid=True)  # fmt: skip


async def generated_before(
    r: aioredis.Redis, keys: Keys, rid: str, epoch: int, ids: list[int]
) -> None:
    """What a dead owner of `rid` left behind: its epoch, and the ids it published."""
    await r.hset(keys.state(rid), mapping={"epoch": epoch, "status": "running", "api_id": "api-1"})
    if ids:
        await r.rpush(keys.ids(rid), *ids)
