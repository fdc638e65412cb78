"""Waiting for a condition, bounded in time (a test fails rather than hangs)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def wait_until(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not await cond():
            await asyncio.sleep(0.01)
