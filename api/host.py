"""What the TokenizerManager's collaborators (aborts, gaps, waiting, streams, liveness,
orphans) use of it, as a Protocol: they take the manager as `Core` (or a Protocol built on it)
instead of importing it, so no module imports back into the one that owns it."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

import redis.asyncio as aioredis

from api.metrics import ApiMetrics
from api.req_state import ReqState
from api.tokenization import TextTokenizer
from shared import protocol
from shared.config import Settings
from shared.keys import Keys


class Core(Protocol):
    settings: Settings
    redis: aioredis.Redis
    keys: Keys
    api_id: str
    rid_to_state: dict[str, ReqState]
    tok: TextTokenizer
    metrics: ApiMetrics

    def spawn(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run `coro` in the background (awaited on close); False when there is no loop."""

    def supersede(self, state: ReqState) -> None:
        """Another attachment holds the request now: its waiter here ends quietly."""

    def apply(self, state: ReqState, entry: protocol.TextEntry) -> None:
        """One entry for a registered state, as if the listener had received it."""

    def resync(self) -> None:
        """Ask for every live request's text again from where this replica is."""
