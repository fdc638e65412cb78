"""Connecting to Redis. Nothing key-specific lives here.

Commands are packed by hiredis (C), as redis-py's synchronous client already does: the
asyncio client packs in Python, copying its growing buffer once per argument, and a
scheduler's step transaction has thousands of arguments at hundreds of running requests."""

from __future__ import annotations

from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection


def connect(url: str) -> aioredis.Redis:
    """An asyncio client (bytes in, bytes out). Does no I/O until first used."""
    pool = aioredis.ConnectionPool.from_url(url, decode_responses=False, health_check_interval=30)
    pool.connection_class = with_hiredis_packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def with_hiredis_packing(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """`cls` (TCP, TLS or unix socket) packing its commands with hiredis."""
    return type(f"Hiredis{cls.__name__}", (_HiredisPacking, cls), {})


class _HiredisPacking:
    def pack_command(self, *args: Any) -> list[bytes]:
        # As redis-py: a command name with a space ("CLIENT SETNAME") is several words.
        if isinstance(args[0], str) and " " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a value hiredis does not take: redis-py's own error for it
            return super().pack_command(*args)  # type: ignore[misc]
