"""API keys (`--api-key`, several allowed): every route but the probes and /metrics needs one,
and the openai client's error classes map (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from api.middleware import OPEN_PATHS
from redserve.cli import build_parser, settings_from_args
from shared.config import Settings
from tests.support.app import running_app, with_api
from tests.support.backend import FakeBackend

KEYS = ["first-key", "second-key"]


@pytest.fixture
async def secured(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, backend: FakeBackend
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with running_app(with_api(settings, api_keys=KEYS), fake_redis, tokenizer) as pair:
        yield pair


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for path, item in app.openapi()["paths"].items():
        path = path.replace("{model_id}", "m").replace("{rid}", "r")
        out.extend((method.upper(), path) for method in item)
    return out


async def test_every_route_but_health_needs_a_key(
    secured: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    app, client = secured
    routes = _routes(app) + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nope")]
    assert len(routes) > 15
    for method, path in routes:
        resp = await client.request(method, path, json={})
        expected = 200 if path in OPEN_PATHS else 401
        assert resp.status_code == expected, (method, path, resp.text)


@pytest.mark.parametrize("key", KEYS)
async def test_each_key_is_accepted(secured: tuple[FastAPI, httpx.AsyncClient], key: str) -> None:
    _app, client = secured
    headers = {"authorization": f"Bearer {key}"}
    resp = await client.post("/generate", json={"text": "hi"}, headers=headers)
    assert resp.status_code == 200, resp.text
    resp = await client.get("/v1/models", headers={"authorization": f"bearer {key}"})
    assert resp.status_code == 200


def test_api_key_flag_repeats() -> None:
    args = build_parser().parse_args(["api", "--api-key", "a", "--api-key", "b"])
    assert settings_from_args(args).api.api_keys == ["a", "b"]


@pytest.fixture
async def secured_oai(
    secured: tuple[FastAPI, httpx.AsyncClient],
) -> AsyncIterator[tuple[FastAPI, openai.AsyncOpenAI]]:
    app, _client = secured
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        api_key=KEYS[1], base_url="http://test/v1", http_client=http, max_retries=0
    ) as c:
        yield app, c


async def test_openai_client_error_classes(
    secured_oai: tuple[FastAPI, openai.AsyncOpenAI], backend: FakeBackend
) -> None:
    app, oai = secured_oai
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.completions.create(model="m", prompt="x", max_tokens=10**6)
    assert "maximum context length" in bad.value.message
    assert bad.value.status_code == 400 and bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await oai.get("/requests/unknown-rid", cast_to=object)
    wrong = oai.with_options(api_key="not-a-key")
    with pytest.raises(openai.AuthenticationError) as denied:
        await wrong.completions.create(model="m", prompt="x", max_tokens=2)
    assert denied.value.code == "invalid_api_key"
    ok = await oai.completions.create(model="m", prompt="x", max_tokens=2)
    assert ok.choices[0].text
    assert backend.jobs and len(backend.jobs) == 1
