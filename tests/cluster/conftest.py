"""A session-wide local Redis Cluster (tests/support/cluster.py) for the cluster tests.

Test modules that use `cluster_url` set `pytestmark = pytest.mark.redis` themselves: the
marker says they start real redis-servers (tests/conftest.py only marks `redis_url` users)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import LocalCluster


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A seed url of a 3-master cluster shared by the session (tests use unique keys)."""
    with LocalCluster() as cluster:
        yield cluster.url
