"""The compare-and-set scripts under resumable streams (shared/reattach.py) and the event log
on fakeredis: only the attachment that owns a response appends to its log, and only at its
end; a takeover moves the attachment, the api ids and the held-rid sets at once and returns
the log as of that moment; an abort is written only where the request is still held."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.event_log import Appends, EventLog, Lost, decode_records
from api.renderers import Event, Mark
from shared import reattach
from shared.keys import Keys

RIDS = ["r_0", "r_1"]


async def _submitted(r: aioredis.Redis, keys: Keys, api_id: str = "a") -> None:
    async with r.pipeline(transaction=True) as pipe:
        for rid in RIDS:
            pipe.hset(keys.state(rid), mapping={"status": "running", "api_id": api_id})
        reattach.hold(pipe, keys, api_id, RIDS)
        reattach.save_stream(pipe, keys, RIDS, '{"kind":"generate"}', f"{api_id}/1")
        await pipe.execute()


async def test_only_the_owner_appends_and_only_at_the_end(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await _submitted(fake_redis, keys)
    log = EventLog(fake_redis, keys, "r_0", "a/1")
    framed = await log.append([Event(b"data: 1\n\n", Mark(0, 2, 2, False)), Event(b"data: 2\n\n")])
    assert framed == [(0, b"id: 0\ndata: 1\n\n"), (1, b"id: 1\ndata: 2\n\n")]
    records = decode_records(await reattach.read_events(fake_redis, keys, "r_0"))
    assert [r.data for r in records] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert records[0].mark == Mark(0, 2, 2, False) and records[1].mark is None
    stale = await reattach.append_events(fake_redis, keys, "r_0", "a/1", 1, [b"x"])
    assert stale == reattach.DIVERGED
    other = await reattach.append_events(fake_redis, keys, "r_0", "b/1", 2, [b"x"])
    assert other == reattach.LOST
    gone = await reattach.append_events(fake_redis, keys, "nope", "a/1", 0, [b"x"])
    assert gone == reattach.GONE


async def test_a_takeover_moves_everything_at_once(fake_redis: aioredis.Redis, keys: Keys) -> None:
    await _submitted(fake_redis, keys)
    log = EventLog(fake_redis, keys, "r_0", "a/1")
    await log.append([Event(b"data: 1\n\n")])
    snapshot = await reattach.take_over(fake_redis, keys, RIDS, ("a", "a/1"), ("b", "b/1"))
    assert snapshot is not None and len(snapshot) == 1
    assert await reattach.held_rids(fake_redis, keys, "a") == set()
    assert await reattach.held_rids(fake_redis, keys, "b") == set(RIDS)
    for rid in RIDS:
        assert await fake_redis.hget(keys.state(rid), "api_id") == b"b"
    with pytest.raises(Lost):  # the former owner can write nothing after it
        await log.append([Event(b"data: 2\n\n")])
    again = await reattach.take_over(fake_redis, keys, RIDS, ("a", "a/1"), ("c", "c/1"))
    assert again is None  # it moved meanwhile: re-read and try again
    assert await reattach.attach_id_of(fake_redis, keys, "r_0") == "b/1"


async def test_aborts_are_written_only_where_the_request_is_still_held(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await _submitted(fake_redis, keys)
    await fake_redis.hset(keys.state("r_1"), "status", "finished")
    assert await reattach.abort_if_held(fake_redis, keys, RIDS, "b") == []
    assert await reattach.abort_if_held(fake_redis, keys, RIDS, "a", ("r_0", "a/2")) == []
    assert await reattach.abort_if_held(fake_redis, keys, RIDS, "a", ("r_0", "a/1")) == ["r_0"]
    assert await fake_redis.exists(keys.abort("r_0"))
    assert not await fake_redis.exists(keys.abort("r_1"))  # it had finished


async def test_the_appends_of_many_streams_share_one_round_trip_and_fail_alone(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    async with fake_redis.pipeline(transaction=True) as pipe:
        for i in range(8):
            pipe.hset(keys.state(f"s{i}"), mapping={"status": "running", "api_id": "a"})
            reattach.save_stream(pipe, keys, [f"s{i}"], '{"kind":"generate"}', f"a/{i}")
        await pipe.execute()
    appends = Appends(fake_redis, keys)
    sent: list[int] = []
    send = appends._send

    async def counted(batch: list[Any]) -> None:
        sent.append(len(batch))
        await send(batch)

    appends._send = counted  # type: ignore[method-assign]
    logs = [EventLog(fake_redis, keys, f"s{i}", f"a/{i}", appends=appends) for i in range(8)]
    logs[3].attach_id = "b/1"  # another replica took this one over
    results = await asyncio.gather(
        *(log.append([Event(b"data: %d\n\n" % i)]) for i, log in enumerate(logs)),
        return_exceptions=True,
    )
    assert sent == [8]  # one pipeline for the eight streams
    assert isinstance(results[3], Lost)
    assert [r for i, r in enumerate(results) if i != 3] == [
        [(0, b"id: 0\ndata: %d\n\n" % i)] for i in range(8) if i != 3
    ]
    for i in range(8):
        assert len(await reattach.read_events(fake_redis, keys, f"s{i}")) == (i != 3)
