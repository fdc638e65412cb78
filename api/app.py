"""`create_app(settings)`: the api tier's FastAPI app (SGLang's http_server over Redis).

Construction does no I/O. The lifespan connects Redis (unless one is injected), loads the
tokenizer and model facts (unless a tokenizer is injected), checks the fleet's stream shard
count (when Redis answers), starts the TokenizerManager and its one result listener, and
closes them on exit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI

from api.errors import install_error_handlers
from api.middleware import EdgeGuard
from api.model import Tokenizer, load_model_info
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S
from api.routes import router
from api.tokenizer_manager import TokenizerManager
from shared import request_stream
from shared.config import Settings
from shared.redis_conn import connect

logger = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    *,
    redis: aioredis.Redis | None = None,
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    """The api app. `redis` and `tokenizer` are injected by tests (and left open on exit)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if redis is None and not settings.redis_url:
            raise RuntimeError("the api tier needs a Redis URL (REDSERVE_REDIS_URL)")
        model = await asyncio.to_thread(load_model_info, settings, tokenizer)
        client = redis if redis is not None else connect(settings.redis_url, settings.redis_cluster)
        await _check_layout(client, settings)
        manager = TokenizerManager(settings, client, model)
        await manager.start()
        app.state.manager = manager
        logger.info("api %s ready (model %s)", settings.api.api_id, model.served_model_name)
        try:
            yield
        finally:
            app.state.manager = None
            await manager.close()
            if redis is None:
                await client.aclose()

    app = FastAPI(
        title="redserve",
        summary="LLM inference over Redis",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.manager = None
    install_error_handlers(app)
    app.include_router(router)
    # uvicorn has no body limit of its own: EdgeGuard's 413 is the only one.
    app.add_middleware(
        EdgeGuard,
        api_keys=settings.api.api_keys,
        max_body_bytes=settings.api.max_body_bytes,
        max_upload_bytes=settings.api.max_file_bytes,
    )
    return app


async def _check_layout(client: aioredis.Redis, settings: Settings) -> None:
    """Refuse to start with another stream shard count than the fleet's; with Redis away or
    hung, start anyway (the api serves 503s until it is back)."""
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):  # a hung Redis must not stop the start
            await request_stream.check_layout(client, settings.redis_keys())
    except request_stream.LayoutMismatch as e:
        logger.error("%s", e)
        raise
    except REDIS_ERRORS as e:
        logger.warning("stream shard count not checked: Redis unavailable (%s)", e)
