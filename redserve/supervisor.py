"""`redserve up`: embedded Redis (with --redis-cluster, a local 3-node Redis Cluster) + one
process per tier; one Ctrl-C stops everything. While
the fleet starts it logs each scheduler's loading progress, then when it is ready to serve.

The tiers get their settings through REDSERVE_* environment variables, exactly as a compose
deployment would give them, so `up` exercises the same code paths as separate machines.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redserve.startup import wait_ready
from shared.config import Settings, child_process_env
from shared.embedded_cluster import LocalCluster
from shared.embedded_redis import EmbeddedRedis
from shared.model_files import resolve_model

logger = logging.getLogger(__name__)

TIERS = ("scheduler", "detokenizer", "api", "jobs")
# Stopping: the jobs worker first (its batches stop feeding and are picked up again by the
# next start), then schedulers drain (their running requests finish while the api and the
# detokenizer still carry the output), then the api (its in-flight requests end), then the
# detokenizer. Each gets its own time: a scheduler's is its drain time and then some.
STOP_ORDER = ("jobs", "scheduler", "api", "detokenizer")


def start_tiers(
    settings: Settings, log_dir: Path | None = None
) -> dict[str, subprocess.Popen[bytes]]:
    """One OS process per tier; with `log_dir`, each tier's output goes to `{tier}.log`. On
    a Redis Cluster there is no jobs tier (arq needs one Redis)."""
    env = child_process_env(settings)
    procs = {}
    for tier in TIERS:
        if tier == "jobs" and settings.redis_cluster:
            continue
        out = open(log_dir / f"{tier}.log", "wb") if log_dir else None  # noqa: SIM115
        procs[tier] = subprocess.Popen(
            [sys.executable, "-m", "redserve.cli", tier],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    return procs


def stop_tiers(
    procs: dict[str, subprocess.Popen[bytes]], timeout_s: float = 10.0, drain_s: float = 30.0
) -> None:
    """SIGTERM each tier in STOP_ORDER and wait for it (`timeout_s` each, the scheduler and
    the api `drain_s` more: they drain), killing one that does not stop in time."""
    for tier in sorted(procs, key=lambda t: STOP_ORDER.index(t) if t in STOP_ORDER else 99):
        proc = procs[tier]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s + (drain_s if tier in ("scheduler", "api") else 0))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", tier)
            proc.kill()
            proc.wait()


def wait_healthy(settings: Settings, procs: dict[str, subprocess.Popen[bytes]]) -> bool:
    """Until the fleet is ready (True) or a tier exited, logging each scheduler's progress."""

    def running() -> bool:
        return all(p.poll() is None for p in procs.values())

    return asyncio.run(wait_ready(settings, running, logger.info))


def supervise(procs: dict[str, subprocess.Popen[bytes]]) -> int:
    """Block until a tier exits (then report it) or we are told to stop."""
    while True:
        for tier, proc in procs.items():
            code = proc.poll()
            if code is not None:
                logger.error("%s exited with %s; stopping the stack", tier, code)
                return code or 1
        time.sleep(0.5)


def up(settings: Settings) -> None:
    redis: EmbeddedRedis | LocalCluster | None = None
    if not settings.redis_url:
        redis = LocalCluster() if settings.redis_cluster else EmbeddedRedis()
        settings.redis_url = redis.start()
        what = "3-node Redis Cluster" if settings.redis_cluster else "redis-server"
        logger.info("embedded %s at %s", what, settings.redis_url)
    # Convert the model once here so the tiers do not race for it.
    settings.model = resolve_model(settings.model, settings.cache_dir)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    code = 0

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    # Explicit for SIGINT too: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        procs = start_tiers(settings)
        if wait_healthy(settings, procs):
            logger.info(
                "redserve is ready: http://%s:%d  (Ctrl-C stops everything)",
                settings.api.host,
                settings.api.port,
            )
        code = supervise(procs)
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        stop_tiers(procs, drain_s=settings.scheduler.drain_s)
        if redis:
            redis.stop()
    sys.exit(code)
