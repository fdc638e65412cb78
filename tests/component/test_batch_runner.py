"""A batch's run (workers.batch.runner) on fakeredis, its lines answered by the fake back end
through the jobs worker's own api app: every custom_id written exactly once (also when a run
starts over after an earlier one died mid-way), bad lines into the error file, cancel and
expiry, the record's statuses and counts. arq itself needs a real Redis: tests/e2e."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import msgspec
import pytest
import redis.asyncio as aioredis

from shared import batches
from shared.batch_lines import result_line
from shared.batches import BatchRecord
from shared.config import JobsSettings, Settings
from shared.file_store import FileStore
from shared.keys import Keys
from tests.support.backend import FakeBackend
from workers.batch.fleet_client import FleetClient, replica_settings
from workers.batch.journal import result_file_ids
from workers.batch.runner import BatchRun

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def settings(model_path: str, keys: Keys, tmp_path: Path) -> Settings:
    return Settings(model=model_path, key_prefix=keys.prefix, files_dir=str(tmp_path),
                    jobs=JobsSettings(worker_id="w1", max_lines_in_flight=3))  # fmt: skip


@pytest.fixture
async def backend(
    fake_server: fakeredis.FakeServer, keys: Keys, tokenizer: Any
) -> AsyncIterator[FakeBackend]:
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    fake = FakeBackend(r, keys, tokenizer)
    task = asyncio.create_task(fake.run())
    yield fake
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await r.aclose()


@pytest.fixture
async def client(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> AsyncIterator[FleetClient]:
    client = FleetClient(settings, fake_redis, tokenizer)
    await client.start()
    yield client
    await client.close()


def _lines(n: int, bad: set[int] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    out = []
    for i in range(n):
        messages = [] if i in bad else [{"role": "user", "content": f"question {i}"}]
        body = {"messages": messages, "max_tokens": 4}
        out.append({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body})
    return out


async def _batch(
    r: aioredis.Redis, keys: Keys, settings: Settings, lines: list[dict[str, Any]], **fields: Any
) -> BatchRecord:
    store = FileStore(r, keys, settings.files_path())
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    await store.fill("file-in", lambda f: f.write(data))
    await store.add("file-in", "in.jsonl", "batch")
    now = int(time.time())
    record = BatchRecord(id="batch_t", endpoint=CHAT, input_file_id="file-in",
                         completion_window="24h", status="validating", created_at=now,
                         expires_at=now + 86400, total=len(lines))  # fmt: skip
    record = msgspec.structs.replace(record, **fields)
    await batches.create(r, keys, record)
    return record


def _read(settings: Settings, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = (settings.files_path() / file_id).read_text()
    return [json.loads(line) for line in text.splitlines()]


async def test_a_batch_runs_to_completed_with_each_line_once(
    settings: Settings, fake_redis: aioredis.Redis, keys: Keys, client: FleetClient,
    backend: FakeBackend,
) -> None:  # fmt: skip
    record = await _batch(fake_redis, keys, settings, _lines(7, bad={2}))
    status = await BatchRun(settings, fake_redis, client, record).run()
    assert status == "completed"
    done = await batches.get(fake_redis, keys, record.id)
    assert done is not None and done.status == "completed"
    assert (done.total, done.completed, done.failed) == (7, 6, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output, errors = _read(settings, done.output_file_id), _read(settings, done.error_file_id)
    assert sorted(x["custom_id"] for x in output) == [f"c{i}" for i in range(7) if i != 2]
    for entry in output:
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        assert entry["response"]["body"]["object"] == "chat.completion"
    (bad,) = errors
    assert bad["custom_id"] == "c2" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "messages"
    assert all(job.priority == -1 for job in backend.jobs)  # the low band
    store = FileStore(fake_redis, keys, settings.files_path())
    made = await store.get(done.output_file_id or "")
    assert made is not None and made.purpose == "batch_output"
    assert not await fake_redis.exists(keys.batch_lines(record.id))
    assert not await fake_redis.sismember(keys.active_batches, record.id)


async def test_a_rerun_skips_what_was_written_and_resends_what_was_in_flight(
    settings: Settings, fake_redis: aioredis.Redis, keys: Keys, client: FleetClient,
    backend: FakeBackend,
) -> None:  # fmt: skip
    record = await _batch(fake_redis, keys, settings, _lines(6), status="in_progress", attempt=1)
    # What a run killed mid-batch left: two lines written (one torn half-way), one in flight.
    out_id, _ = result_file_ids(record.id)
    part = FileStore(fake_redis, keys, settings.files_path()).part_path(out_id)
    written = [result_line(f"c{i}", f"old-{i}", 200, {"earlier": True}) for i in (0, 3)]
    part.write_bytes(b"".join(written) + written[0][:20])
    await fake_redis.hset(keys.batch_lines(record.id), mapping={"c1": "old-1", "c3": "old-3"})
    status = await BatchRun(settings, fake_redis, client, record).run()
    assert status == "completed"
    output = _read(settings, out_id)
    assert sorted(x["custom_id"] for x in output) == [f"c{i}" for i in range(6)]
    assert [x["response"]["body"] for x in output[:2]] == [{"earlier": True}] * 2
    sent = sorted(job.rid for job in backend.jobs)
    assert sent == sorted(f"{record.id}-{i}-1-0" for i in (1, 2, 4, 5))
    assert await fake_redis.exists(keys.abort("old-1"))  # the earlier run's line: aborted
    assert not await fake_redis.exists(keys.abort("old-3"))  # written already: left alone
    done = await batches.get(fake_redis, keys, record.id)
    assert done is not None and (done.completed, done.failed) == (6, 0)


async def test_a_cancelled_batch_stops_and_keeps_what_finished(
    settings: Settings, fake_redis: aioredis.Redis, keys: Keys, client: FleetClient,
    backend: FakeBackend,
) -> None:  # fmt: skip
    record = await _batch(fake_redis, keys, settings, _lines(4))
    await batches.transition(fake_redis, keys, record.id, "cancelling")
    assert await BatchRun(settings, fake_redis, client, record).run() == "cancelled"
    done = await batches.get(fake_redis, keys, record.id)
    assert done is not None and done.status == "cancelled" and done.cancelled_at
    assert done.output_file_id is None and backend.jobs == []


async def test_an_expired_batch_fails_its_unfinished_lines(
    settings: Settings, fake_redis: aioredis.Redis, keys: Keys, client: FleetClient,
    backend: FakeBackend,
) -> None:  # fmt: skip
    record = await _batch(fake_redis, keys, settings, _lines(3), expires_at=int(time.time()) - 1)
    assert await BatchRun(settings, fake_redis, client, record).run() == "expired"
    done = await batches.get(fake_redis, keys, record.id)
    assert done is not None and done.status == "expired" and done.failed == 3
    errors = _read(settings, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["c0", "c1", "c2"]
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in errors)


async def test_a_vanished_input_file_fails_the_batch(
    settings: Settings, fake_redis: aioredis.Redis, keys: Keys, client: FleetClient
) -> None:
    record = await _batch(fake_redis, keys, settings, _lines(2))
    (settings.files_path() / "file-in").unlink()
    assert await BatchRun(settings, fake_redis, client, record).run() == "failed"
    done = await batches.get(fake_redis, keys, record.id)
    assert done is not None and done.status == "failed" and done.errors


def test_the_jobs_replica_needs_no_key_and_has_its_own_api_id(settings: Settings) -> None:
    settings.api.api_keys = ["secret"]
    settings.api.rate_limit_rps = 1
    replica = replica_settings(settings)
    assert replica.api.api_id == "jobs-w1" and replica.api.api_keys == []
    assert replica.api.rate_limit_rps == 0 and settings.api.api_keys == ["secret"]
