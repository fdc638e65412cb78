"""`redserve health api|scheduler|jobs`: a container healthcheck (liveness, not readiness).

api: GET /live answers 200 (the replica runs and Redis answers; /health, its readiness, also
needs a ready scheduler, which is not this container's health). scheduler: a scheduler on this
host has a fresh heartbeat and has loaded its model (worker ids start with the host name, and
heartbeat keys expire when a worker stops beating). jobs: a jobs worker on this host beats.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

from shared import heartbeat
from shared.config import Settings
from shared.heartbeat import JOBS, SCHEDULER, SchedulerBeat
from shared.redis_conn import REDIS_FAILURES, connect


def check(settings: Settings, tier: str) -> int:
    try:
        if tier == "api":
            alive = _api_alive(settings)
        elif tier == "jobs":
            alive = asyncio.run(_jobs_alive(settings))
        else:
            alive = asyncio.run(_scheduler_alive(settings))
    except REDIS_FAILURES:
        alive = False
    return 0 if alive else 1


def _api_alive(settings: Settings) -> bool:
    url = f"http://127.0.0.1:{settings.api.port}/live"
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


async def _scheduler_alive(settings: Settings) -> bool:
    r = connect(settings.redis_url, settings.redis_cluster)
    keys = settings.redis_keys()
    host = socket.gethostname()
    try:
        beats = await heartbeat.live_beats(r, keys, SCHEDULER, SchedulerBeat)
    finally:
        await r.aclose()
    return any(w.startswith(host) and b.state != "loading" for w, b in beats.items())


async def _jobs_alive(settings: Settings) -> bool:
    r = connect(settings.redis_url, settings.redis_cluster)
    try:
        keys = settings.redis_keys()
        live = await heartbeat.live_workers(r, keys, JOBS, socket.gethostname())
    finally:
        await r.aclose()
    return bool(live)
