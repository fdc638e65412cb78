"""A stand-in for scheduler + detokenizer: reads GenerateJobs from the request stream and
publishes TextBatch messages (one entry per job per step) to the api's output channel, with
made-up but deterministic logprobs and embeddings. Like the scheduler it marks each request
finished in its state hash and acks (XACK + XDEL) its job; aborted jobs are dropped."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import redis.asyncio as aioredis

from shared import protocol, request_state, request_stream
from shared.keys import Keys

REPLY = " The answer is four. Four is a small number, and it is even."
EOS_ID = 2
VOCAB = 49152
EMBED_DIM = 8


def fake_logprob(pos: int, token_id: int) -> float:
    """The made-up logprob of `token_id` at position `pos` (output or prompt)."""
    return -round(0.01 * ((pos * 31 + token_id) % 700) + 0.001, 6)


def fake_top_ids(pos: int, token_id: int, n: int) -> list[int]:
    return [(token_id + k * 7 + pos) % VOCAB for k in range(n)]


def fake_logprobs(
    positions: range, ids: list[int], req: protocol.LogprobRequest
) -> protocol.Logprobs:
    """Logprobs for `ids` at `positions` as the engine would send them."""
    tops = [fake_top_ids(p, t, req.top_n) for p, t in zip(positions, ids, strict=True)]
    return protocol.Logprobs(
        token_logprobs=[fake_logprob(p, t) for p, t in zip(positions, ids, strict=True)],
        top_ids=tops if req.top_n else [],
        top_logprobs=[
            [fake_logprob(p, t) for t in row] for p, row in zip(positions, tops, strict=True)
        ]
        if req.top_n
        else [],
        requested_logprobs=[[fake_logprob(p, t) for t in req.token_ids] for p in positions]
        if req.token_ids
        else [],
    )


def fake_embedding(input_ids: list[int]) -> list[float]:
    raw = [math.sin(sum(input_ids) * (k + 1) + len(input_ids)) for k in range(EMBED_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


class FakeBackend:
    def __init__(self, redis: aioredis.Redis, keys: Keys, tokenizer: Any, chunk: int = 2) -> None:
        self.redis = redis
        self.keys = keys
        self.tokenizer = tokenizer
        self.chunk = chunk
        self.reply = REPLY
        self.jobs: list[protocol.GenerateJob] = []
        self.hold = False  # read jobs but never answer them
        # Jobs whose rid starts with this are held until aborted, then dropped and acked.
        self.hold_prefix: str | None = None
        self.partial = False  # answer only the first step of each job
        self.step_delay = 0.0  # seconds between steps
        self.new_job = asyncio.Event()
        self._entry_ids: dict[str, bytes] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reply_ids: list[int] = []

    def reply_ids(self, job: protocol.GenerateJob) -> list[int]:
        if not self._reply_ids:
            self._reply_ids = self.tokenizer.encode(self.reply)
        return self._reply_ids[: job.sampling.max_new_tokens]

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for task in self._tasks:
                task.cancel()

    async def _run(self) -> None:
        await request_stream.ensure_group(self.redis, self.keys)
        while True:
            got = await request_stream.read(self.redis, self.keys, "fake-scheduler", 64, 20)
            jobs = [job for _entry, job in got if job is not None]
            for entry_id, job in got:
                if job is not None:
                    self._entry_ids[job.rid] = entry_id
            self.jobs.extend(jobs)
            if jobs:
                self.new_job.set()
            if self.hold_prefix is not None:
                for job in jobs:
                    if job.rid.startswith(self.hold_prefix):
                        task = asyncio.create_task(self._until_aborted(job))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                jobs = [job for job in jobs if not job.rid.startswith(self.hold_prefix)]
            if jobs and not self.hold:
                await self.answer(jobs)

    async def wait_jobs(self, n: int, timeout: float = 5.0) -> list[protocol.GenerateJob]:
        async with asyncio.timeout(timeout):
            while len(self.jobs) < n:
                self.new_job.clear()
                await self.new_job.wait()
        return self.jobs

    def _finish(
        self, job: protocol.GenerateJob, end: int, num: int
    ) -> protocol.FinishReason | None:
        if end < num:
            return None
        if num == job.sampling.max_new_tokens:
            return protocol.FinishReason(type="length", length=num)
        return protocol.FinishReason(type="stop", matched=EOS_ID)

    def _entry(self, job: protocol.GenerateJob, start: int) -> protocol.TextEntry:
        if job.embed:
            return protocol.TextEntry(
                rid=job.rid,
                epoch=1,
                seq=0,
                text="",
                token_ids=[],
                prompt_tokens=len(job.input_ids),
                completion_tokens=0,
                finish=protocol.FinishReason(type="length", length=0),
                embedding=fake_embedding(job.input_ids),
            )
        ids = self.reply_ids(job)
        end = min(start + self.chunk, len(ids))
        skip = job.detok.skip_special_tokens
        before = self.tokenizer.decode(ids[:start], skip_special_tokens=skip)
        text = self.tokenizer.decode(ids[:end], skip_special_tokens=skip)
        entry = protocol.TextEntry(
            rid=job.rid,
            epoch=1,
            seq=start,
            text=text[len(before) :],
            token_ids=ids[start:end],
            prompt_tokens=len(job.input_ids),
            completion_tokens=end,
            finish=self._finish(job, end, len(ids)),
        )
        if job.logprobs is not None:
            entry.output_logprobs = fake_logprobs(range(start, end), ids[start:end], job.logprobs)
            if start == 0 and job.logprobs.start_len >= 0:
                entry.input_logprobs = self._input_logprobs(job, job.logprobs)
        return entry

    def _input_logprobs(
        self, job: protocol.GenerateJob, req: protocol.LogprobRequest
    ) -> protocol.Logprobs:
        # Like an engine: prompt positions from start_len to the end, the first prompt
        # token (which nothing predicts) left out.
        first = max(req.start_len, 1)
        ids = job.input_ids[first:]
        return fake_logprobs(range(first, first + len(ids)), ids, req)

    async def answer(self, jobs: list[protocol.GenerateJob]) -> None:
        """One TextBatch per step, carrying every job that advanced (like the detokenizer)."""
        starts = {job.rid: 0 for job in jobs if not await self._aborted(job)}
        while starts:
            entries = [self._entry(job, starts[job.rid]) for job in jobs if job.rid in starts]
            await self.publish(jobs[0].detok.api_id, entries)
            for entry in entries:
                if entry.finish is not None:
                    del starts[entry.rid]
                    await self._done(entry.rid, entry.finish, entry.completion_tokens)
                else:
                    starts[entry.rid] += len(entry.token_ids)
            if self.partial:
                return
            await asyncio.sleep(self.step_delay)

    async def _until_aborted(self, job: protocol.GenerateJob) -> None:
        while not await self._aborted(job):
            await asyncio.sleep(0.02)

    async def _aborted(self, job: protocol.GenerateJob) -> bool:
        if not await self.redis.exists(self.keys.abort(job.rid)):
            return False
        await self._done(job.rid, protocol.FinishReason(type="abort"), 0)
        return True

    async def _done(self, rid: str, reason: protocol.FinishReason, completion: int) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            request_state.finish(pipe, self.keys, rid, reason, completion)
            entry_id = self._entry_ids.pop(rid, None)
            if entry_id is not None:
                request_stream.ack(pipe, self.keys, entry_id)
            await pipe.execute()

    async def publish(self, api_id: str, entries: list[protocol.TextEntry]) -> None:
        batch = protocol.TextBatch(entries=entries)
        await self.redis.publish(self.keys.output_channel(api_id), protocol.encode(batch))
