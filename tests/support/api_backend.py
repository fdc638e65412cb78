"""A stand-in for scheduler + detokenizer that a test drives step by step, for the api's
failover tests. Like the real tiers it marks jobs running (epoch 1), appends each step's ids to
the id log, marks requests finished (or aborted, once their abort marker appears) and acks
their jobs; like the real detokenizer it obeys Reattach on the control channel: a rid's text
goes to the new api replica from then on, and from_seqs >= 0 sends it again from that seq. It
beats as a ready scheduler ("scripted") so the api's readiness sees one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import protocol, request_state, request_stream
from shared.keys import Keys
from tests.support.backend import EOS_ID, REPLY, fake_logprobs
from tests.support.beats import BEAT_EVERY_S, beat_once


class ScriptedBackend:
    def __init__(self, redis: aioredis.Redis, keys: Keys, tokenizer: Any, chunk: int = 2) -> None:
        self.redis = redis
        self.keys = keys
        self.tokenizer = tokenizer
        self.chunk = chunk
        self.jobs: dict[str, protocol.GenerateJob] = {}
        self.pos: dict[str, int] = {}  # per rid: the seq of its next step
        self.route: dict[str, str] = {}  # per rid: the api replica its text goes to
        self.reattaches: list[protocol.Reattach] = []
        self.resend = True  # obey from_seqs
        self.ids = tokenizer.encode(REPLY)
        self._entry_ids: dict[str, bytes] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> ScriptedBackend:
        await request_stream.ensure_group(self.redis, self.keys)
        ready = asyncio.Event()
        self._tasks = [
            asyncio.create_task(_retrying(self._read_jobs)),
            asyncio.create_task(_retrying(lambda: self._control(ready))),
            asyncio.create_task(_retrying(self._reap_aborts)),
            asyncio.create_task(_retrying(self._beat)),  # a ready scheduler, for /health
        ]
        await asyncio.wait_for(ready.wait(), 5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- driving ---------------------------------------------------------------------------
    def total(self, rid: str) -> int:
        return min(len(self.ids), self.jobs[rid].sampling.max_new_tokens)

    async def wait_job(self, rid: str, timeout: float = 5.0) -> protocol.GenerateJob:
        async with asyncio.timeout(timeout):
            while rid not in self.jobs:
                await asyncio.sleep(0.01)
        return self.jobs[rid]

    async def step(self, rid: str, steps: int = 1) -> None:
        """Publish the next `steps` steps of rid (chunk tokens each), as the tiers would."""
        for _ in range(steps):
            start = self.pos[rid]
            if start >= self.total(rid) and start > 0:
                return
            end = min(start + self.chunk, self.total(rid))
            self.pos[rid] = end
            entry = self.entry(rid, start, end)
            async with self.redis.pipeline(transaction=False) as pipe:
                request_state.append_ids(pipe, self.keys, rid, self.ids[start:end])
                if entry.finish is not None:
                    request_state.finish(pipe, self.keys, rid, entry.finish, end)
                    request_stream.ack(pipe, self.keys, self._entry_ids.pop(rid))
                await pipe.execute()
            await self.publish(rid, entry)

    async def finish(self, rid: str) -> None:
        while self.pos[rid] < self.total(rid):
            await self.step(rid)

    def entry(self, rid: str, start: int, end: int) -> protocol.TextEntry:
        """The text of ids[start:end], with the finish if it reaches the end."""
        job, ids = self.jobs[rid], self.ids
        before = self.tokenizer.decode(ids[:start], skip_special_tokens=True)
        text = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
        finish = None
        if end >= self.total(rid):
            finish = (
                protocol.FinishReason(type="length", length=end)
                if end == job.sampling.max_new_tokens
                else protocol.FinishReason(type="stop", matched=EOS_ID)
            )
        entry = protocol.TextEntry(
            rid=rid, epoch=1, seq=start, text=text[len(before) :], token_ids=ids[start:end],
            prompt_tokens=len(job.input_ids), completion_tokens=end, finish=finish,
        )  # fmt: skip
        if job.logprobs is not None:
            entry.output_logprobs = fake_logprobs(range(start, end), ids[start:end], job.logprobs)
        return entry

    async def publish(self, rid: str, entry: protocol.TextEntry) -> None:
        batch = protocol.TextBatch(entries=[entry])
        await self.redis.publish(self.keys.output_channel(self.route[rid]), protocol.encode(batch))

    # -- the tiers' loops ------------------------------------------------------------------
    async def _read_jobs(self) -> None:
        while True:
            got = await request_stream.read(self.redis, self.keys, "scripted", 64, 20)
            for entry_id, job in got:
                if job is None:
                    continue
                self.jobs[job.rid] = job
                self.pos[job.rid] = 0
                self.route[job.rid] = job.detok.api_id
                self._entry_ids[job.rid] = entry_id
                async with self.redis.pipeline(transaction=False) as pipe:
                    request_state.mark_running(pipe, self.keys, job.rid, "scripted", 1)
                    await pipe.execute()

    async def _control(self, ready: asyncio.Event) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.keys.control_channel)
            ready.set()
            while True:
                msg = await pubsub.get_message(timeout=0.1)
                if msg is None or msg.get("type") != "message":
                    continue
                control = protocol.decode(msg["data"], protocol.ControlMessage)
                if isinstance(control, protocol.Reattach):
                    self.reattaches.append(control)
                    await self._reattach(control)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _reattach(self, msg: protocol.Reattach) -> None:
        for rid, seq in zip(msg.rids, msg.from_seqs or [-1] * len(msg.rids), strict=True):
            if rid not in self.jobs:
                continue
            self.route[rid] = msg.api_id
            if self.resend and 0 <= seq < self.pos[rid]:
                await self.publish(rid, self.entry(rid, seq, self.pos[rid]))

    async def _beat(self) -> None:
        while True:
            await beat_once(self.redis, self.keys, "scripted")
            await asyncio.sleep(BEAT_EVERY_S)

    async def _reap_aborts(self) -> None:
        """Like a scheduler: an aborted running request is marked aborted and acked."""
        while True:
            for rid in list(self._entry_ids):
                if await self.redis.exists(self.keys.abort(rid)):
                    reason = protocol.FinishReason(type="abort")
                    async with self.redis.pipeline(transaction=False) as pipe:
                        request_state.finish(pipe, self.keys, rid, reason, self.pos[rid])
                        request_stream.ack(pipe, self.keys, self._entry_ids.pop(rid))
                        await pipe.execute()
            await asyncio.sleep(0.02)


async def _retrying(loop: Callable[[], Awaitable[None]]) -> None:
    """Run a loop again after a Redis error (a restarted Redis), as the real tiers do."""
    while True:
        try:
            await loop()
        except (RedisError, OSError):
            await asyncio.sleep(0.1)
