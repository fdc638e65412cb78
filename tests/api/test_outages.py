"""Redis outages and a full Redis (DESIGN §4.8) on real redis-servers (each test its own, with
AOF, so that a kill -9 and a restart keep the data): new requests get a 503 with an error body
within 2 s, /health is 503 while Redis is away, streams in flight end with an error event if
it stays away, or finish normally when it is back in time (the api asks for a resend of what
it missed), a pub/sub connection that Redis cut off is made good the same way, and a full
Redis (maxmemory + noeviction) is a 503 that says so. Nothing crashes, nothing is a 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared.config import Settings
from shared.embedded_redis import EmbeddedRedis
from shared.keys import Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.api_faults import SseClient, text_of
from tests.support.app import API_ID, running_app
from tests.support.backend import REPLY
from tests.support.waiting import wait_until

pytestmark = pytest.mark.redis

CHAT = [{"role": "user", "content": "hi"}]
NEW_REQUESTS = [
    ("/generate", {"text": "hi"}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
]


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    redis = EmbeddedRedis(appendonly=True)
    redis.start()
    yield redis
    redis.stop()


@contextlib.asynccontextmanager
async def stack(
    settings: Settings, url: str, keys: Keys, tokenizer: Any
) -> AsyncIterator[tuple[Any, Any, ScriptedBackend]]:
    """The app and a scripted back end, each on its own connection to `url`."""
    app_redis, backend_redis = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
    try:
        async with ScriptedBackend(backend_redis, keys, tokenizer) as backend:
            async with running_app(settings, app_redis, tokenizer) as (app, client):
                yield app, client, backend
    finally:
        await app_redis.aclose()
        await backend_redis.aclose()


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    """A TCP port that accepts connections and never answers: a hung Redis."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read()

    srv = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        for writer in writers:
            writer.close()
        srv.close()


async def assert_new_requests_get_503(client: Any) -> None:
    for path, body in NEW_REQUESTS:
        started = time.monotonic()
        resp = await client.post(path, json=body)
        assert time.monotonic() - started < 2.0, path
        assert resp.status_code == 503, (path, resp.text)
        assert resp.headers["retry-after"] == "1"
        error = resp.json()["error"]
        assert error["message"]
        if path.startswith("/v1/"):
            assert error["type"] == "server_error" and error["code"]


async def test_a_hung_redis_gets_new_requests_a_503_within_2s(
    settings: Settings, tokenizer: Any
) -> None:
    async with silent_server() as port:
        hung = aioredis.Redis(host="127.0.0.1", port=port)
        async with running_app(settings, hung, tokenizer) as (app, client):
            await assert_new_requests_get_503(client)
            started = time.monotonic()
            assert (await client.get("/health")).status_code == 503
            assert time.monotonic() - started < 2.0
            assert app.state.manager.rid_to_state == {}
        await hung.aclose()


async def test_streams_end_with_an_error_event_when_redis_stays_away(
    settings: Settings, server: EmbeddedRedis, keys: Keys, tokenizer: Any
) -> None:
    async with stack(settings, server.url, keys, tokenizer) as (app, client, backend):
        body = {"prompt": "hi", "rid": "away", "stream": True, "max_tokens": 9}
        stream = SseClient(app).start("POST", "/v1/completions", body)
        await backend.wait_job("away")
        await backend.step("away")
        await stream.wait_events(1)
        server.kill()
        gone = time.monotonic()
        assert (await client.get("/health")).status_code == 503
        await assert_new_requests_get_503(client)
        outage_s = settings.api.redis_outage_s
        await stream.finished(timeout=outage_s + 5)
        assert outage_s <= time.monotonic() - gone < outage_s + 4
        frames = stream.frames
        assert [i for i, _ in frames] == list(range(len(frames)))
        assert frames[-1][1] == "[DONE]"
        error = json.loads(frames[-2][1])["error"]
        assert "Redis has been unreachable" in error["message"] and error["type"] == "server_error"
        assert json.loads(frames[-3][1])["choices"][0]["finish_reason"] == "abort"
        assert app.state.manager.rid_to_state == {}
        server.start()  # back: the abort it could not write is written now
        check = aioredis.Redis.from_url(server.url)
        await wait_until(lambda: check.exists(keys.abort("away")), timeout=10)
        await wait_until(lambda: _healthy(client), timeout=10)
        await check.aclose()


async def test_streams_finish_normally_when_redis_is_back_in_time(
    settings: Settings, server: EmbeddedRedis, keys: Keys, tokenizer: Any
) -> None:
    async with stack(settings, server.url, keys, tokenizer) as (app, _client, backend):
        body = {"text": "hi", "rid": "blip", "stream": True,
                "sampling_params": {"max_new_tokens": 9}}  # fmt: skip
        stream = SseClient(app).start("POST", "/generate", body)
        await backend.wait_job("blip")
        await backend.step("blip")
        await stream.wait_events(1)
        server.kill()
        await asyncio.sleep(1.0)
        server.start()
        await backend.step("blip")  # most likely before the api subscribed again: lost
        await wait_until(lambda: _asked(backend), timeout=10)
        await backend.finish("blip")
        await stream.finished(timeout=10)
    frames = stream.frames
    assert [i for i, _ in frames] == list(range(len(frames))) and frames[-1][1] == "[DONE]"
    assert text_of("generate", frames) == _reply(tokenizer, 9)
    assert not any(d.startswith('{"error"') for _i, d in frames)


async def test_a_subscription_that_redis_cut_off_is_made_good(
    settings: Settings, server: EmbeddedRedis, keys: Keys, tokenizer: Any
) -> None:
    async with stack(settings, server.url, keys, tokenizer) as (app, _client, backend):
        body = {"prompt": "hi", "rid": "cut", "stream": True, "max_tokens": 9}
        stream = SseClient(app).start("POST", "/v1/completions", body)
        await backend.wait_job("cut")
        await backend.step("cut")
        await stream.wait_events(1)
        admin = aioredis.Redis.from_url(server.url)
        await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # as for a slow reader
        await backend.step("cut")
        await wait_until(lambda: _asked(backend), timeout=10)
        await backend.finish("cut")
        await stream.finished(timeout=10)
        await admin.aclose()
    assert text_of("completion", stream.frames) == _reply(tokenizer, 9)


async def test_a_full_redis_is_a_503_that_says_so(
    settings: Settings, server: EmbeddedRedis, tokenizer: Any
) -> None:
    r = aioredis.Redis.from_url(server.url)
    async with running_app(settings, r, tokenizer) as (app, client):
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", "1")
        try:
            answers = [await client.post(path, json=body) for path, body in NEW_REQUESTS]
        finally:
            await r.config_set("maxmemory", "0")
        for resp in answers:
            assert resp.status_code == 503, resp.text
            assert "out of memory" in resp.json()["error"]["message"]
        native, oai, _chat = (a.json()["error"] for a in answers)
        assert set(native) == {"message"}
        assert oai["code"] == "redis_out_of_memory" and oai["type"] == "server_error"
        assert app.state.manager.rid_to_state == {}
        assert (await client.get("/live")).status_code == 200  # full is not gone (no scheduler)
    await r.aclose()


async def _healthy(client: Any) -> bool:
    return bool((await client.get("/health")).status_code == 200)


async def _asked(backend: ScriptedBackend) -> bool:
    return any(m.api_id == API_ID for m in backend.reattaches)


def _reply(tokenizer: Any, n: int) -> str:
    return str(tokenizer.decode(tokenizer.encode(REPLY)[:n], skip_special_tokens=True))
