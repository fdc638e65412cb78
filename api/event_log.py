"""A streaming response's event log (`events:{rid}`, DESIGN §4.9): every SSE event is
appended to it BEFORE the client may see it, under the event id it is sent with (the list
index), so that a re-attach on any replica replays exactly what was sent and goes on from
there. Each record keeps the event's bytes and its renderer Mark.

Appends are compare-and-set on the response's attachment: a replica that lost the request
to a re-attach gets Lost and stops. A Redis outage is retried for LOG_OUTAGE_S; after that
(or at once while the replica already knows Redis is down) the log is given up on and the
events go on to the client unlogged, still numbered, so that the stream can end with its
error event instead of hanging. The appends of all streams go to Redis together (Appends):
a per-stream round trip per event was the api's largest cost at hundreds of streams."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from api import sse
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S
from api.renderers import Event, Mark
from shared import reattach
from shared.keys import Keys

logger = logging.getLogger(__name__)

LOG_OUTAGE_S = 3.0


class Lost(Exception):
    """Another attachment owns the response now."""


class EventRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    data: bytes  # the event as sent, or its compact form (api.renderers.Event.compact)
    mark: Mark | None = None
    compact: bool = False

    @property
    def is_final(self) -> bool:
        return self.data == sse.DONE


_decoder = msgspec.msgpack.Decoder(EventRecord)
_encoder = msgspec.msgpack.Encoder()


def decode_records(raw: list[bytes]) -> list[EventRecord]:
    return [_decoder.decode(r) for r in raw]


def _record(event: Event) -> EventRecord:
    if event.compact is not None:
        return EventRecord(event.compact, event.mark, compact=True)
    return EventRecord(event.data, event.mark)


def frame(event_id: int, data: bytes) -> bytes:
    """The event as sent: its id line, then its `data:` line(s) and blank line."""
    return b"id: %d\n" % event_id + data


class Appends:
    """The event-log appends of all of a replica's streams, sent together: whatever the
    streams queue while one pipeline is out goes in the next, so N streams cost one round
    trip per turn instead of N (each append is still its own compare-and-set script)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self._queued: list[tuple[tuple[str, str, int, list[bytes]], asyncio.Future[int]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def append(self, rid: str, attach_id: str, first_id: int, records: list[bytes]) -> int:
        """reattach.append_events' result for these records (or its exception)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queued.append(((rid, attach_id, first_id, records), done))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all())
        return await done

    async def _send_all(self) -> None:
        try:
            while self._queued:
                await asyncio.sleep(0)  # the streams woken in this turn queue theirs first
                batch, self._queued = self._queued, []
                await self._send(batch)
        finally:
            self._sender = None

    async def _send(self, batch: list[tuple[tuple[str, str, int, list[bytes]], Any]]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for args, _ in batch:
                    reattach.queue_append(pipe, self.keys, *args)
                results = await pipe.execute(raise_on_error=False)
        except BaseException as e:  # every waiter hears it; a cancellation goes on up
            for _, done in batch:
                if not done.done():
                    done.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for (_, done), result in zip(batch, results, strict=True):
            if done.done():  # its waiter timed out
                continue
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(int(result))


class EventLog:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        rid: str,
        attach_id: str,
        next_id: int = 0,
        redis_down: Callable[[], bool] = lambda: False,
        appends: Appends | None = None,
    ) -> None:
        self.keys = keys
        self.rid = rid
        self.attach_id = attach_id
        self.next_id = next_id
        self.redis_down = redis_down
        self.appends = appends or Appends(redis, keys)
        self.broken = False  # given up on: events go on unlogged

    async def append(self, events: list[Event]) -> list[tuple[int, bytes]]:
        """Log `events` (raises Lost if another attachment owns the response); returns them
        with their ids, framed."""
        if not events:
            return []
        if not self.broken:
            records = [_encoder.encode(_record(e)) for e in events]
            await self._write(records)
        first, self.next_id = self.next_id, self.next_id + len(events)
        return [(first + i, frame(first + i, e.data)) for i, e in enumerate(events)]

    async def _write(self, records: list[bytes]) -> None:
        give_up_at = 0.0
        backoff = 0.05
        while True:
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    result = await self.appends.append(
                        self.rid, self.attach_id, self.next_id, records
                    )
                break
            except REDIS_ERRORS as e:
                now = time.monotonic()
                give_up_at = give_up_at or now + LOG_OUTAGE_S
                if now >= give_up_at or self.redis_down():
                    logger.error("rid=%s: event log given up (%r); streaming on unlogged",
                                 self.rid, e)  # fmt: skip
                    self.broken = True
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
        if result == reattach.LOST:
            raise Lost(self.rid)
        if result in (reattach.DIVERGED, reattach.GONE):
            why = "has no state any more" if result == reattach.GONE else "does not end there"
            logger.error("rid=%s: event log %s (id %d); streaming on unlogged", self.rid, why,
                         self.next_id)  # fmt: skip
            self.broken = True
