"""The fault tests' fleet: a real redis-server with AOF and real `redserve` processes on the
real model (fp32, greedy), started once per module; a test kills, freezes and restarts them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from shared.config import SchedulerSettings, Settings
from shared.embedded_redis import EmbeddedRedis
from tests.support.fleet import Fleet, Tap


@pytest.fixture(scope="module")
def fleet(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    server = EmbeddedRedis(appendonly=True)
    url = server.start()
    settings = Settings(
        redis_url=url,
        key_prefix=f"f{uuid.uuid4().hex[:6]}",
        model=model_path,
        scheduler=SchedulerSettings(
            dtype="float32", quantization="none", kv_cache_tokens=4096, num_threads=1
        ),
    )
    fleet = Fleet(server, settings, tmp_path_factory.mktemp("fleet-logs"))
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def tap(stack: Fleet) -> Iterator[Tap]:
    """What reaches the api replica "api" during one case (each module defines `stack`)."""
    tap = Tap(stack)
    yield tap
    tap.close()
