"""One run of a batch (the arq task `run_batch`): its lines through the fleet at the jobs
tier's priority, at most `jobs.max_lines_in_flight` at once, each answer appended to the
output or error file as it comes, the counts in the batch's record going up with it.

Idempotent by (batch, custom_id): the journal (workers.batch.journal) holds every line
written, a rerun skips them; the lines an earlier run had sent and not written are aborted
and sent again. A cancel (status cancelling) or the end of the completion window stops the
feeding and aborts the lines in flight; an expired batch's unfinished lines go to the error
file as `batch_expired`. The run holds the batch's lease while it runs (workers.batch.lease)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis.asyncio as aioredis

from shared import batches
from shared.batch_lines import BatchLine, LineError, failed_line, read_lines, result_line
from shared.batches import BatchRecord
from shared.config import Settings
from shared.file_store import FileStore
from shared.redis_conn import atomic
from workers.batch.fleet_client import FleetClient, LineAnswer
from workers.batch.journal import Journal, result_file_ids

logger = logging.getLogger(__name__)

# Answers that mean "not now" (admission full, fleet draining, Redis away): sent again later.
RETRY_STATUSES = frozenset({429, 503})
_RETRY_MAX_S = 5.0
_STATUS_EVERY_S = 0.5  # how often the run looks for a cancel or a newer run
_CHUNK = 256  # input lines read per thread hop
CANCELLED = "The batch was cancelled."
EXPIRED = "This request could not be executed before the completion window expired."


class Superseded(Exception):
    """A newer run of this batch took over (the recovery thought this one dead)."""


class InputFileError(Exception):
    """The batch's input file went away or no longer reads as it did when checked."""


class BatchRun:
    def __init__(
        self, settings: Settings, redis: aioredis.Redis, client: FleetClient, record: BatchRecord
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = settings.redis_keys()
        self.client = client
        self.record = record
        self.store = FileStore(redis, self.keys, settings.files_path())
        out_id, err_id = result_file_ids(record.id)
        self.file_ids = {True: out_id, False: err_id}
        self.journal = Journal(self.store.part_path(out_id), self.store.part_path(err_id))
        self._checked_at = 0.0
        self._stop: str | None = None

    async def run(self) -> str:
        """Run to the end: the status the batch ended with."""
        await asyncio.to_thread(self.journal.open)
        try:
            if self.record.status == "validating":
                await batches.transition(self.redis, self.keys, self.record.id, "in_progress")
            await self._settle_earlier_run()
            if await self._check_stop() is None:
                await self._feed()
            return await self._finish()
        except InputFileError as e:
            return await self._fail(str(e))
        finally:
            self.journal.close()

    async def _fail(self, message: str) -> str:
        logger.error("batch %s failed: %s", self.record.id, message)
        errors = {"object": "list", "data": [{"code": "input_file_error", "message": message}]}
        await batches.transition(self.redis, self.keys, self.record.id, "failed", errors=errors)
        return "failed"

    # -- feeding -----------------------------------------------------------------------------
    async def _feed(self) -> None:
        in_flight: set[asyncio.Task[None]] = set()
        limit = self.settings.jobs.max_lines_in_flight
        try:
            async for line in self._lines():
                if line.custom_id in self.journal.done:
                    continue
                while len(in_flight) >= limit and self._stop is None:
                    await self._wait(in_flight)
                if self._stop is not None or await self._check_stop() is not None:
                    break
                in_flight.add(asyncio.create_task(self._run_line(line)))
            while in_flight and self._stop is None:
                await self._wait(in_flight)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        if self._stop is not None:
            await self._abort_sent(CANCELLED if self._stop == "cancelled" else EXPIRED)

    async def _wait(self, in_flight: set[asyncio.Task[None]]) -> None:
        done, _ = await asyncio.wait(in_flight, timeout=_STATUS_EVERY_S,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        in_flight.difference_update(done)
        for task in done:
            task.result()  # a failed write fails the run (its lease lapses, it is recovered)
        await self._check_stop()

    async def _run_line(self, line: BatchLine) -> None:
        jobs = self.settings.jobs
        body = dict(line.body)
        given = body.get("priority")
        body["priority"] = min(given, jobs.priority) if isinstance(given, int) else jobs.priority
        for attempt in itertools.count():
            rid = f"{self.record.id}-{line.index}-{self.record.attempt}-{attempt}"
            body["rid"] = rid
            await self.redis.hset(self.keys.batch_lines(self.record.id), line.custom_id, rid)  # type: ignore[misc]
            answer = await self.client.send(self.record.endpoint, body)
            if answer.status_code not in RETRY_STATUSES:
                break
            await asyncio.sleep(min(answer.retry_after or 1.0, _RETRY_MAX_S))
        await self._write(line.custom_id, rid, answer)

    async def _write(self, custom_id: str, rid: str, answer: LineAnswer) -> None:
        ok = answer.status_code == 200
        entry = result_line(custom_id, rid, answer.status_code, answer.body)
        self.journal.write(custom_id, entry, ok)
        async with atomic(self.redis) as pipe:
            pipe.hdel(self.keys.batch_lines(self.record.id), custom_id)
            batches.count(pipe, self.keys, self.record.id, "completed" if ok else "failed")
            await pipe.execute()

    async def _lines(self) -> AsyncIterator[BatchLine]:
        """The input file's requests, read in a thread a chunk at a time."""
        path = self.store.path(self.record.input_file_id)
        chunks = _chunks(path, self.record.endpoint, self.settings.api.max_batch_requests)
        while True:
            try:
                chunk = await asyncio.to_thread(next, chunks, list[BatchLine]())
            except (OSError, LineError) as e:
                raise InputFileError(
                    f"Could not read input file {self.record.input_file_id}: {e}"
                ) from e
            if not chunk:
                return
            for line in chunk:
                yield line

    # -- stopping ----------------------------------------------------------------------------
    async def _check_stop(self) -> str | None:
        """"cancelled" or "expired" once the batch must stop (read at most every
        _STATUS_EVERY_S); raises Superseded when a newer run owns the batch."""
        now = time.monotonic()
        if self._stop is not None or now - self._checked_at < _STATUS_EVERY_S:
            return self._stop
        self._checked_at = now
        record = await batches.get(self.redis, self.keys, self.record.id)
        if record is None or record.attempt != self.record.attempt:
            raise Superseded(self.record.id)
        if record.status == "cancelling":
            self._stop = "cancelled"
        elif time.time() >= record.expires_at:
            self._stop = "expired"
        return self._stop

    async def _settle_earlier_run(self) -> None:
        """Abort what an earlier run sent and did not write (its answers went to a process
        that is gone); those lines are sent again."""
        sent = await self.redis.hgetall(self.keys.batch_lines(self.record.id))  # type: ignore[misc]
        rids = [v.decode() for k, v in sent.items() if k.decode() not in self.journal.done]
        if rids:
            logger.info("batch %s: aborting %d lines of an earlier run", self.record.id, len(rids))
            await self.client.abort(rids, "Sent again by a later run of its batch.")
        await self.redis.delete(self.keys.batch_lines(self.record.id))
        await batches.set_fields(self.redis, self.keys, self.record.id,
                                 completed=self.journal.counts[True],
                                 failed=self.journal.counts[False])  # fmt: skip

    async def _abort_sent(self, message: str) -> None:
        sent = await self.redis.hgetall(self.keys.batch_lines(self.record.id))  # type: ignore[misc]
        await self.client.abort([v.decode() for v in sent.values()], message)

    # -- the end -----------------------------------------------------------------------------
    async def _finish(self) -> str:
        batch_id = self.record.id
        if self._stop == "expired":
            async for line in self._lines():
                if line.custom_id not in self.journal.done:
                    self.journal.write(line.custom_id,
                                       failed_line(line.custom_id, "batch_expired", EXPIRED),
                                       False)  # fmt: skip
                    await self.redis.hincrby(self.keys.batch(batch_id), "failed", 1)  # type: ignore[misc]
        status = {"cancelled": "cancelled", "expired": "expired"}.get(self._stop or "", "")
        if not status:
            status = "completed"
            await batches.transition(self.redis, self.keys, batch_id, "finalizing")
        self.journal.close()
        fields = await self._publish()
        found = await batches.transition(self.redis, self.keys, batch_id, status, **fields)
        if not batches.moved(found, status):  # cancelled while finalizing
            status = "cancelled"
            await batches.transition(self.redis, self.keys, batch_id, status, **fields)
        await self.redis.delete(self.keys.batch_lines(batch_id))
        logger.info("batch %s %s: %d ok, %d failed", batch_id, status, self.journal.counts[True],
                    self.journal.counts[False])  # fmt: skip
        return status

    async def _publish(self) -> dict[str, str | None]:
        """The output and error files (each only if it has a line) as store files."""
        fields: dict[str, str | None] = {}
        for ok, name in ((True, "output"), (False, "error")):
            file_id = self.file_ids[ok]
            if self.journal.counts[ok]:
                await self.store.add(file_id, f"{self.record.id}_{name}.jsonl", "batch_output")
                fields[f"{name}_file_id"] = file_id
            else:
                await self.store.discard_part(file_id)
        return fields


def _chunks(path: Any, endpoint: str, max_lines: int) -> Iterator[list[BatchLine]]:
    with open(path, "rb") as f:
        chunk: list[BatchLine] = []
        for line in read_lines(f, endpoint, max_lines):
            chunk.append(line)
            if len(chunk) == _CHUNK:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
