"""The result listener and the TokenizerManager's dispatch: garbage is survived, stale epochs
and duplicate seqs are dropped, and every request ends with one terminal output."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from shared import protocol
from shared.keys import Keys
from tests.support.app import API_ID, sse_events
from tests.support.backend import FakeBackend


def entry(
    rid: str, epoch: int, seq: int, text: str, ids: list[int], **kw: object
) -> protocol.TextEntry:
    return protocol.TextEntry(
        rid=rid, epoch=epoch, seq=seq, text=text, token_ids=ids, prompt_tokens=1,
        completion_tokens=seq + len(ids), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def test_survives_garbage(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
) -> None:
    channel = keys.output_channel(API_ID)
    for junk in (b"garbage", b"", protocol.encode(protocol.AbortRequests(rids=["x"])),
                 protocol.encode(protocol.TextBatch(entries=[], v=99))):  # fmt: skip
        await fake_redis.publish(channel, junk)
    stray = protocol.TextBatch(entries=[entry("not-mine", 1, 0, "x", [5], finish=None)])
    await fake_redis.publish(channel, protocol.encode(stray))
    resp = await client.post(
        "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    )
    assert resp.status_code == 200
    listener = app.state.manager.listener
    assert listener.num_dropped >= 3 and listener.subscribed
    assert (await client.get("/health")).status_code == 200


async def test_stale_epoch_and_duplicates_dropped(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
) -> None:
    backend.hold = True
    body = {"text": "hi", "rid": "e", "stream": True}
    waiting = asyncio.create_task(client.post("/generate", json=body))
    await backend.wait_jobs(1)
    stop = protocol.FinishReason(type="stop", matched=".")
    script = [
        entry("e", 1, 0, "A", [10]),
        entry("e", 2, 1, "B", [11]),  # a reclaim: the new owner resumes at seq 1
        entry("e", 1, 1, "X", [99]),  # stale owner: dropped
        entry("e", 2, 1, "B", [11]),  # duplicate: dropped
        entry("e", 2, 2, "C", [12], finish=stop),
        entry("e", 2, 3, "Z", [13]),  # after the finish: no state any more
    ]
    for e in script:
        await backend.publish(API_ID, [e])
    resp = await waiting
    chunks = [json.loads(x) for x in sse_events(resp.text)[:-1]]
    final = chunks[-1]
    assert final["text"] == "ABC" and final["output_ids"] == [10, 11, 12]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}
    assert sum(c["meta_info"]["finish_reason"] is not None for c in chunks) == 1
    assert app.state.manager.rid_to_state == {}


async def test_gap_is_tolerated(
    client: httpx.AsyncClient, backend: FakeBackend, app: FastAPI
) -> None:
    backend.hold = True
    waiting = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "g"}))
    await backend.wait_jobs(1)
    await backend.publish(API_ID, [entry("g", 1, 0, "A", [10])])
    # seq 1 was lost by pub/sub; the request still finishes with what arrived.
    finish = protocol.FinishReason(type="length", length=3)
    await backend.publish(API_ID, [entry("g", 1, 2, "C", [12], finish=finish)])
    out = (await waiting).json()
    assert out["text"] == "AC" and out["meta_info"]["completion_tokens"] == 3


async def test_one_subscription_per_process(app: FastAPI, fake_redis: aioredis.Redis) -> None:
    channels = await fake_redis.pubsub_channels()
    assert len([c for c in channels if c.endswith(f":out:{API_ID}".encode())]) == 1



async def test_the_schedulers_control_messages_pass_quietly(
    app: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    """The api hears the whole control channel; pause, continue and flush are not for it."""
    for message in (protocol.PauseGeneration(mode="retract"), protocol.ContinueGeneration(),
                    protocol.FlushCache()):  # fmt: skip
        app.state.manager.dispatch(message)
    assert "no handler" not in caplog.text
