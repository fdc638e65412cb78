"""The api under test: settings with a few ApiSettings changed, another app running beside the
fixture's (its lifespan on, a client for it), and reading SSE bodies."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis.asyncio as aioredis
from fastapi import FastAPI

from api.app import create_app
from shared.config import Settings

API_ID = "api-test"


def with_api(settings: Settings, **update: Any) -> Settings:
    """`settings` with some ApiSettings fields changed."""
    return settings.model_copy(update={"api": settings.api.model_copy(update=update)})


@contextlib.asynccontextmanager
async def running_app(
    settings: Settings, redis: aioredis.Redis, tokenizer: Any
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """Another app (its lifespan running) and a client for it."""
    app = create_app(settings, redis=redis, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield app, client


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way: every event is
    its `id: N` line, then one `data:` line."""
    return [data for _id, data in sse_frames(body)]


def sse_frames(body: str) -> list[tuple[int, str]]:
    """(id, data) of each event of an SSE body."""
    assert body.endswith("\n\n")
    frames = []
    for event in body.split("\n\n")[:-1]:
        head, sep, data = event.partition("\ndata: ")
        assert head.startswith("id: ") and sep, event
        frames.append((int(head.removeprefix("id: ")), data))
    return frames
