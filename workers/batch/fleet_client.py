"""How the jobs tier sends a batch line into the fleet: through an api app of its own, in
this process (httpx's ASGI transport, no socket), so a line is validated, templated, tokenized,
queued, answered and rendered exactly as the same request sent to an api replica, and its
answer comes back to this process (the app is a replica of the fleet, `jobs-{worker_id}`)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import httpx
import msgspec
import redis.asyncio as aioredis

from api.app import create_app
from api.tokenizer_manager import TokenizerManager
from shared.config import Settings


class LineAnswer(msgspec.Struct, frozen=True):
    status_code: int
    body: Any
    retry_after: float | None = None


def replica_settings(settings: Settings) -> Settings:
    """The settings of the jobs worker's api replica: its own api_id; no API keys or per-key
    limits (nothing but this process reaches it, and the jobs tier bounds its own lines in
    flight). The fleet-wide queue bound still applies: a 503 sends a line again later."""
    copy = settings.model_copy(deep=True)
    api = copy.api
    api.api_id = f"jobs-{settings.jobs.worker_id}"
    api.api_keys = []
    api.rate_limit_rps = 0
    api.max_concurrent_requests_per_key = 0
    return copy


class FleetClient:
    def __init__(
        self, settings: Settings, redis: aioredis.Redis | None = None, tokenizer: Any = None
    ) -> None:
        """`redis` and `tokenizer` are the api app's injected ones (tests)."""
        self.app = create_app(replica_settings(settings), redis=redis, tokenizer=tokenizer)
        self._stack = AsyncExitStack()
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        transport = httpx.ASGITransport(app=self.app)
        self.http = await self._stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://jobs", timeout=None)
        )

    async def close(self) -> None:
        await self._stack.aclose()
        self.http = None

    @property
    def manager(self) -> TokenizerManager:
        manager: TokenizerManager = self.app.state.manager
        return manager

    async def send(self, endpoint: str, body: dict[str, Any]) -> LineAnswer:
        assert self.http is not None, "start() first"
        response = await self.http.post(endpoint, json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": {"message": response.text[:1000]}}
        return LineAnswer(response.status_code, payload, _seconds(response.headers))

    async def abort(self, rids: list[str], message: str) -> None:
        """Abort requests wherever they run (their former holder may be a dead process)."""
        if rids:
            await self.manager.abort_request(rids, message=message)


def _seconds(headers: httpx.Headers) -> float | None:
    """Retry-After in seconds (the api sends numbers), None if absent or not a number."""
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None
