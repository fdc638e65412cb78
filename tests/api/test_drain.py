"""SIGTERM on an api replica (DESIGN §4.10), through DrainingServer's signal handler: /health
and new requests answer 503 at once while the socket stays open, the requests in flight
finish, and only then does uvicorn shut down; past the drain time, streams are handed to the
fleet (left running for a re-attach, not aborted) and the rest end with a 503."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI

from api.drain import DrainingServer
from shared import reattach
from shared.keys import Keys
from tests.support.api_faults import SseClient
from tests.support.app import API_ID
from tests.support.backend import FakeBackend


def server_for(app: FastAPI, drain_s: float) -> DrainingServer:
    return DrainingServer(uvicorn.Config(app), app, drain_s)


async def test_sigterm_drains_then_shuts_down(
    app: FastAPI, client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.hold = True
    inflight = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "in"}))
    stream = SseClient(app).start("POST", "/generate", {"text": "hi", "rid": "st", "stream": True})
    await backend.wait_jobs(2)
    server = server_for(app, drain_s=5)
    server.handle_exit(signal.SIGTERM, None)
    health = await client.get("/health")
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
    new = await client.post("/v1/completions", json={"prompt": "hi"})
    assert new.status_code == 503 and new.json()["error"]["type"] == "server_error"
    assert not server.should_exit  # still draining: the socket stays open
    await backend.answer(list(backend.jobs))  # the requests in flight finish
    assert (await inflight).status_code == 200
    assert (await stream.finished()).endswith(b"data: [DONE]\n\n")
    assert server.draining is not None
    await asyncio.wait_for(server.draining, 5)
    assert server.should_exit


async def test_past_the_drain_time_streams_are_handed_over_and_the_rest_get_503(
    app: FastAPI,
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
) -> None:
    backend.hold = True
    inflight = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "in"}))
    stream = SseClient(app).start("POST", "/generate", {"text": "hi", "rid": "st", "stream": True})
    await backend.wait_jobs(2)
    server = server_for(app, drain_s=0.3)
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0.1)
    assert server.draining is not None
    await asyncio.wait_for(server.draining, 5)
    assert server.should_exit
    resp = await inflight
    assert resp.status_code == 503 and "shutting down" in resp.json()["error"]["message"]
    body = await stream.finished()
    assert b"[DONE]" not in body  # cut off: the client re-attaches on another replica
    assert await fake_redis.exists(keys.abort("in"))
    assert not await fake_redis.exists(keys.abort("st"))  # left running for a re-attach
    assert "st" in await reattach.held_rids(fake_redis, keys, API_ID)


async def test_a_second_signal_skips_the_wait(app: FastAPI, backend: Any) -> None:
    server = server_for(app, drain_s=60)
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit
