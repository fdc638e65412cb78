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


def make_loop(r: aioredis.Redis, keys: Keys, runner: ScriptedRunner, **core: Any) -> SchedulerLoop:
    config: dict[str, Any] = dict(
        num_kv_blocks=32, vocab_size=VOCAB, max_model_len=64, block_size=4, max_num_seqs=8
    )
    scheduler = Scheduler(
        SchedulerConfig(**{**config, **core}, eos_token_ids=frozenset({EOS})),
        decode_tail=lambda ids: "".join(f"<{i}>" for i in ids),
    )
    settings = Settings(scheduler=SchedulerSettings(worker_id="w1", idle_block_ms=5))
    return SchedulerLoop(r, keys, settings, scheduler, runner)


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
