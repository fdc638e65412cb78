"""A stand-in for scheduler + detokenizer: reads GenerateJobs from the request stream and
publishes TextBatch messages (one entry per job per step) to the api's output channel."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from shared import protocol, request_stream
from shared.keys import Keys

REPLY = " The answer is four. Four is a small number, and it is even."
EOS_ID = 2


class FakeBackend:
    def __init__(self, redis: aioredis.Redis, keys: Keys, tokenizer: Any, chunk: int = 2) -> None:
        self.redis = redis
        self.keys = keys
        self.tokenizer = tokenizer
        self.chunk = chunk
        self.reply = REPLY
        self.jobs: list[protocol.GenerateJob] = []
        self.hold = False  # read jobs but never answer them
        self.partial = False  # answer only the first step of each job
        self.new_job = asyncio.Event()

    def reply_ids(self, job: protocol.GenerateJob) -> list[int]:
        ids: list[int] = self.tokenizer.encode(self.reply)
        return ids[: job.sampling.max_new_tokens]

    async def run(self) -> None:
        await request_stream.ensure_group(self.redis, self.keys)
        while True:
            got = await request_stream.read(self.redis, self.keys, "fake-scheduler", 16, 20)
            jobs = [job for _entry, job in got if job is not None]
            self.jobs.extend(jobs)
            if jobs:
                self.new_job.set()
            if jobs and not self.hold:
                await self.answer(jobs)

    async def wait_jobs(self, n: int, timeout: float = 5.0) -> list[protocol.GenerateJob]:
        async with asyncio.timeout(timeout):
            while len(self.jobs) < n:
                self.new_job.clear()
                await self.new_job.wait()
        return self.jobs

    def _entry(self, job: protocol.GenerateJob, start: int) -> protocol.TextEntry:
        ids = self.reply_ids(job)
        end = min(start + self.chunk, len(ids))
        skip = job.detok.skip_special_tokens
        before = self.tokenizer.decode(ids[:start], skip_special_tokens=skip)
        text = self.tokenizer.decode(ids[:end], skip_special_tokens=skip)
        finish = None
        if end == len(ids):
            if len(ids) == job.sampling.max_new_tokens:
                finish = protocol.FinishReason(type="length", length=len(ids))
            else:
                finish = protocol.FinishReason(type="stop", matched=EOS_ID)
        return protocol.TextEntry(
            rid=job.rid,
            epoch=1,
            seq=start,
            text=text[len(before) :],
            token_ids=ids[start:end],
            prompt_tokens=len(job.input_ids),
            completion_tokens=end,
            finish=finish,
        )

    async def answer(self, jobs: list[protocol.GenerateJob]) -> None:
        """One TextBatch per step, carrying every job that advanced (like the detokenizer)."""
        starts = {job.rid: 0 for job in jobs}
        while starts:
            entries = [self._entry(job, starts[job.rid]) for job in jobs if job.rid in starts]
            await self.publish(jobs[0].detok.api_id, entries)
            for entry in entries:
                if entry.finish is not None:
                    del starts[entry.rid]
                else:
                    starts[entry.rid] += len(entry.token_ids)
            if self.partial:
                return
            await asyncio.sleep(0)

    async def publish(self, api_id: str, entries: list[protocol.TextEntry]) -> None:
        batch = protocol.TextBatch(entries=entries)
        await self.redis.publish(self.keys.output_channel(api_id), protocol.encode(batch))
