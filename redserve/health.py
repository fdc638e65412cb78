"""`redserve health api|scheduler`: a container healthcheck.

api: GET /health answers 200. scheduler: a heartbeat of a scheduler on this host is fresh
(worker ids start with the host name, and heartbeat keys expire when a worker stops beating).
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

from shared import heartbeat
from shared.config import Settings
from shared.heartbeat import SCHEDULER
from shared.keys import Keys
from shared.redis_conn import connect


def check(settings: Settings, tier: str) -> int:
    try:
        alive = _api_alive(settings) if tier == "api" else asyncio.run(_scheduler_alive(settings))
    except OSError:
        alive = False
    return 0 if alive else 1


def _api_alive(settings: Settings) -> bool:
    url = f"http://127.0.0.1:{settings.api.port}/health"
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


async def _scheduler_alive(settings: Settings) -> bool:
    r = connect(settings.redis_url)
    keys = Keys(settings.key_prefix)
    try:
        return bool(await heartbeat.live_workers(r, keys, SCHEDULER, socket.gethostname()))
    finally:
        await r.aclose()
