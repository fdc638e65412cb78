"""Connecting to Redis. Nothing key-specific lives here."""

from __future__ import annotations

import redis.asyncio as aioredis


def connect(url: str) -> aioredis.Redis:
    """An asyncio client (bytes in, bytes out). Does no I/O until first used."""
    return aioredis.Redis.from_url(url, decode_responses=False, health_check_interval=30)
