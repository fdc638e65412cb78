"""Fixtures of the api tests: the app on fakeredis with its lifespan running, an ASGI client,
the real SmolLM2 tokenizer, a fake back end that answers jobs, and (for every test) a ready
scheduler's heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from api.app import create_app
from shared.config import ApiSettings, Settings
from shared.keys import Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.app import API_ID
from tests.support.backend import FakeBackend
from tests.support.beats import scheduler_beating


@pytest.fixture(scope="session")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(autouse=True)
async def ready_scheduler(fake_server: fakeredis.FakeServer, keys: Keys) -> AsyncIterator[None]:
    """A ready scheduler's beat on the fake Redis: /health needs one. A test that wants none
    runs its app on a FakeServer of its own."""
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    async with scheduler_beating(r, keys, "fake-scheduler"):
        yield
    await r.aclose()


@pytest.fixture
def settings(model_path: str, keys: Keys) -> Settings:
    return Settings(
        model=model_path,
        key_prefix=keys.prefix,
        api=ApiSettings(api_id=API_ID, disconnect_check_s=0.02, request_timeout_s=30.0),
    )


@pytest.fixture
async def app(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> AsyncIterator[FastAPI]:
    app = create_app(settings, redis=fake_redis, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture
async def backend(
    fake_server: fakeredis.FakeServer, keys: Keys, tokenizer: Any
) -> AsyncIterator[FakeBackend]:
    r = fakeredis.FakeAsyncRedis(server=fake_server)  # its own "process" connection
    fake = FakeBackend(r, keys, tokenizer)
    task = asyncio.create_task(fake.run())
    yield fake
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await r.aclose()


@pytest.fixture
async def scripted(
    fake_server: fakeredis.FakeServer, keys: Keys, tokenizer: Any
) -> AsyncIterator[ScriptedBackend]:
    """A back end a test steps by hand (what reaches whom, resends), on the app's Redis."""
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    async with ScriptedBackend(r, keys, tokenizer) as backend:
        yield backend
    await r.aclose()
