"""The real stack: api, scheduler and detokenizer as separate OS processes on a real
redis-server, serving the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from shared.config import ApiSettings, SchedulerSettings, Settings
from shared.embedded_redis import free_port
from tests.support.stack import Stack, running_stack

ORPHAN_GRACE_S = 0.5


@pytest.fixture(scope="session")
def stack(
    redis_url: str, model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = Settings(
        redis_url=redis_url,
        key_prefix=f"e2e{uuid.uuid4().hex[:6]}",
        model=model_path,
        files_dir=str(tmp_path_factory.mktemp("files")),
        # A stream whose client went away is aborted once this grace passed without a
        # re-attach (GET /v1/requests/{rid}/stream).
        api=ApiSettings(port=free_port(), api_id="e2e-api", orphan_grace_s=ORPHAN_GRACE_S),
        scheduler=SchedulerSettings(
            worker_id="e2e-scheduler", kv_cache_tokens=8192, dtype="float32", quantization="none"
        ),
    )
    with running_stack(settings, tmp_path_factory.mktemp("stack-logs")) as stack:
        yield stack
