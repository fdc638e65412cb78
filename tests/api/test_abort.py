"""Aborts: /abort_request, client disconnects (non-streaming at once, streaming after the
re-attach grace) and timeouts all write the abort to Redis, end the request with one terminal
output, and leave no local state."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from api.app import create_app
from shared import protocol
from shared.config import Settings
from shared.keys import Keys
from tests.support.app import running_app, with_api
from tests.support.asgi import ManualClient
from tests.support.backend import FakeBackend
from tests.support.waiting import wait_until


async def test_abort_request(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
) -> None:
    backend.hold = True
    pubsub = fake_redis.pubsub()
    await pubsub.subscribe(keys.control_channel)
    await pubsub.get_message(timeout=1)  # the subscribe confirmation
    waiting = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "r1"}))
    await backend.wait_jobs(1)

    resp = await client.post("/abort_request", json={"rid": "r1"})
    assert resp.status_code == 200
    assert await fake_redis.exists(keys.abort("r1"))
    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
    assert msg is not None
    assert protocol.decode(msg["data"], protocol.ControlMessage).rids == ["r1"]
    out = (await waiting).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert app.state.manager.rid_to_state == {}
    await pubsub.aclose()


async def test_abort_unknown_rid_still_broadcasts(
    client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    resp = await client.post("/abort_request", json={"rid": "elsewhere"})
    assert resp.status_code == 200
    assert await fake_redis.exists(keys.abort("elsewhere"))


async def test_abort_all_streaming(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
) -> None:
    backend.hold = True
    body = {"text": ["a", "b"], "rid": "all", "stream": True}
    waiting = asyncio.create_task(client.post("/generate", json=body))
    await backend.wait_jobs(2)
    assert (await client.post("/abort_request", json={"abort_all": True})).status_code == 200
    resp = await waiting
    assert resp.text.endswith("data: [DONE]\n\n")
    assert resp.text.count('"type":"abort"') == 2
    for rid in ("all_0", "all_1"):
        assert await fake_redis.exists(keys.abort(rid))
    assert app.state.manager.rid_to_state == {}


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_stream_disconnect_aborts_after_the_grace(
    settings: Settings,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    tokenizer: Any,
    keys: Keys,
    spec_version: str,
) -> None:
    """A streaming request whose client went away keeps running (awaiting a re-attach) for
    orphan_grace_s, then is aborted, and its log ends with the abort chunk and [DONE]."""
    backend.partial = True  # one chunk, then silence
    conf = with_api(settings, orphan_grace_s=0.4)
    async with running_app(conf, fake_redis, tokenizer) as (app, _client):
        manual = ManualClient(app, spec_version)
        body = {"text": "hi", "rid": "s", "stream": True}
        task = asyncio.create_task(manual.post("/generate", body))
        await asyncio.wait_for(manual.got_body.wait(), 5)
        assert manual.status == 200 and manual.body.startswith(b"id: 0\ndata: {")
        gone = time.monotonic()
        manual.disconnect.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.2)
        assert not await fake_redis.exists(keys.abort("s"))  # still waiting for a re-attach
        assert "s" in app.state.manager.rid_to_state
        await wait_until(lambda: fake_redis.exists(keys.abort("s")))
        assert time.monotonic() - gone >= 0.4
        await wait_until(lambda: _empty(app))
        await wait_until(lambda: _logged(fake_redis, keys.events("s"), 3))
        log = await fake_redis.lrange(keys.events("s"), 0, -1)
        assert b'"type":"abort"' in log[1] and b"[DONE]" in log[2]


async def test_non_stream_disconnect_aborts(
    app: FastAPI, backend: FakeBackend, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    backend.hold = True
    manual = ManualClient(app)
    task = asyncio.create_task(manual.post("/v1/completions", {"prompt": "hi", "rid": "ns"}))
    await backend.wait_jobs(1)
    manual.disconnect.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 5)
    await wait_until(lambda: fake_redis.exists(keys.abort("ns")))
    await wait_until(lambda: _empty(app))


async def test_timeout_aborts_with_504(
    settings: Settings,
    fake_redis: aioredis.Redis,
    tokenizer: Any,
    backend: FakeBackend,
    keys: Keys,
) -> None:
    backend.hold = True
    settings = settings.model_copy(
        update={"api": settings.api.model_copy(update={"request_timeout_s": 0.2})}
    )
    app = create_app(settings, redis=fake_redis, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            resp = await client.post("/v1/completions", json={"prompt": "hi", "rid": "slow"})
        assert resp.status_code == 504
        assert "timed out" in resp.json()["error"]["message"]
        assert await fake_redis.exists(keys.abort("slow"))
        assert app.state.manager.rid_to_state == {}


async def _empty(app: FastAPI) -> bool:
    return not app.state.manager.rid_to_state


async def _logged(r: aioredis.Redis, key: str, n: int) -> bool:
    return int(await r.llen(key)) >= n


async def test_shutdown_aborts_running_requests(
    settings: Settings,
    fake_redis: aioredis.Redis,
    tokenizer: Any,
    backend: FakeBackend,
    keys: Keys,
) -> None:
    backend.hold = True
    app = create_app(settings, redis=fake_redis, tokenizer=tokenizer)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        async with app.router.lifespan_context(app):
            waiting = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "z"}))
            await backend.wait_jobs(1)
        resp = await waiting
    assert resp.status_code == 503
    assert "shutting down" in resp.json()["error"]["message"]
    assert await fake_redis.exists(keys.abort("z"))
