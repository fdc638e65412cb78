"""The api's edge: content types (curl's form type read as JSON), the body cap enforced while
the body streams in, fleet-wide unique rids (SET NX), and no state left behind by a request
that fails validation or submission."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from shared.config import Settings
from shared.keys import ABORT_TTL_S, Keys
from tests.support.app import running_app, with_api
from tests.support.backend import FakeBackend
from tests.support.waiting import wait_until

BODY = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'


@pytest.mark.parametrize(
    "content_type",
    [
        "",
        "application/x-www-form-urlencoded",
        "text/plain; charset=utf-8",
        "application/json; charset=utf-8",
        "application/vnd.api+json",
    ],
)
async def test_json_bodies_under_lenient_types(
    client: httpx.AsyncClient, backend: FakeBackend, content_type: str
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    resp = await client.post("/generate", content=BODY, headers=headers)
    assert resp.status_code == 200, resp.text


async def _chunks(total: int, size: int) -> AsyncIterator[bytes]:
    yield b'{"text": "'
    for _ in range(total // size):
        yield b"x" * size
    yield b'"}'


async def test_413_while_streaming_the_body(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, keys: Keys
) -> None:
    small = with_api(settings, max_body_bytes=10_000)
    async with running_app(small, fake_redis, tokenizer) as (_app, client):
        # No Content-Length: only counting the streamed bytes can catch it.
        resp = await client.post("/generate", content=_chunks(50_000, 1000))
        assert resp.status_code == 413
        assert "larger than the limit of 10000 bytes" in resp.json()["error"]["message"]
        resp = await client.post("/generate", content=b'{"text": ""}')  # small: read
        assert resp.status_code == 400
    assert await fake_redis.xlen(keys.request_stream) == 0


async def test_413_stops_reading_early(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> None:
    """Received through raw ASGI: the body is not read past the limit, and with a large
    Content-Length not at all."""
    small = with_api(settings, max_body_bytes=4096)
    async with running_app(small, fake_redis, tokenizer) as (app, _client):
        for content_length, expect_reads in ((None, 5), (10**9, 0)):
            reads, sent = await _raw_post(app, content_length, chunk=1000, chunks=100)
            assert sent[0]["status"] == 413
            assert reads == expect_reads


async def _raw_post(
    app: FastAPI, content_length: int | None, chunk: int, chunks: int
) -> tuple[int, list[dict[str, Any]]]:
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * chunk, "more_body": reads < chunks}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "server": ("t", 80),
        "client": ("c", 1),
    }
    await app(scope, receive, send)
    return reads, sent


async def test_duplicate_rid_across_replicas(
    settings: Settings,
    fake_server: fakeredis.FakeServer,
    client: httpx.AsyncClient,
    backend: FakeBackend,
    tokenizer: Any,
    keys: Keys,
    fake_redis: aioredis.Redis,
) -> None:
    backend.hold = True
    first = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "shared"}))
    await backend.wait_jobs(1)
    other_redis = fakeredis.FakeAsyncRedis(server=fake_server)
    other = with_api(settings, api_id="api-other")
    async with running_app(other, other_redis, tokenizer) as (other_app, other_client):
        resp = await other_client.post("/v1/completions", json={"prompt": "x", "rid": "shared"})
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "Duplicate request ID detected: shared"
        assert other_app.state.manager.rid_to_state == {}
    await other_redis.aclose()
    assert await fake_redis.xlen(keys.request_stream) == 1
    assert await fake_redis.get(keys.rid_claim("shared")) == b"api-test"
    await client.post("/abort_request", json={"rid": "shared"})
    await first
    # An aborted rid stays claimed while its abort marker lives, then expires.
    await wait_until(lambda: _ttl_at_most(fake_redis, keys.rid_claim("shared"), ABORT_TTL_S))


async def _ttl_at_most(r: aioredis.Redis, key: str, limit: int) -> bool:
    return 0 < await r.ttl(key) <= limit


async def test_finished_rid_is_released_and_reusable(
    client: httpx.AsyncClient, backend: FakeBackend, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    body = {"text": "hi", "rid": "again", "sampling_params": {"max_new_tokens": 2}}
    assert (await client.post("/generate", json=body)).status_code == 200
    await wait_until(lambda: _gone(fake_redis, keys.rid_claim("again")))
    assert (await client.post("/generate", json=body)).status_code == 200


async def _gone(r: aioredis.Redis, key: str) -> bool:
    return not await r.exists(key)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hi", "rid": "bad", "sampling_params": {"stop_token_ids": [10**7]}},
        {"input_ids": [1] * 9000, "rid": "bad"},
        {"text": "hi", "rid": "bad", "return_logprob": True, "logprob_start_len": 50},
        {"text": ["a", "b"], "rid": ["bad", "bad"]},
    ],
)
async def test_failed_validation_leaves_no_state(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
    body: dict[str, Any],
) -> None:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert app.state.manager.rid_to_state == {}
    await asyncio.sleep(0.05)  # any background release has run
    for key in (keys.rid_claim("bad"), keys.state("bad")):
        assert not await fake_redis.exists(key)
    ok = await client.post(
        "/generate", json={"text": "x", "rid": "bad", "sampling_params": {"max_new_tokens": 1}}
    )
    assert ok.status_code == 200, ok.text


async def test_failed_submission_releases_the_claim(
    client: httpx.AsyncClient,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from api.errors import ServiceUnavailable

    async def fail(jobs: Any, stream: Any = None) -> None:
        raise ServiceUnavailable("The request queue (Redis) is unavailable.")

    monkeypatch.setattr(app.state.manager, "_submit", fail)
    resp = await client.post("/generate", json={"text": "hi", "rid": "down"})
    assert resp.status_code == 503
    assert app.state.manager.rid_to_state == {}
    await wait_until(lambda: _gone(fake_redis, keys.rid_claim("down")))


async def test_nan_in_logit_bias_names_the_field(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/completions",
        content='{"prompt": "hi", "logit_bias": {"5": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "logit_bias.5"


async def test_bom_is_tolerated(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    body = "\ufeff" + json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    resp = await client.post("/generate", content=body.encode(), headers={"content-type": ""})
    assert resp.status_code == 200, resp.text
