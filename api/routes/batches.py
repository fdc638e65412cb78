"""OpenAI's Batch API: create, retrieve, list, cancel. A batch is checked line by line when
it is created (a bad line is a 400 naming it), recorded in Redis (shared.batches) and queued
for the jobs tier (workers/jobs.py), which runs its lines through the fleet at a low priority
and writes its output and error files."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import Query

from api.deps import TokenizerManagerDep
from api.errors import ApiError, BadRequest, NotFound
from api.redis_errors import REDIS_ERRORS, unavailable
from api.routes.common import make_router
from api.routes.files import file_store, find
from api.schemas.batches import CreateBatchRequest
from api.tokenizer_manager import TokenizerManager
from shared import batches, job_queue
from shared.batch_lines import LineError, read_lines
from shared.batches import COMPLETION_WINDOWS, BatchRecord
from shared.redis_conn import is_cluster

router = make_router("batches")


def _count_lines(path: Any, endpoint: str, max_lines: int) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in read_lines(f, endpoint, max_lines))


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, tm: TokenizerManagerDep) -> dict[str, Any]:
    if is_cluster(tm.redis):  # arq, the jobs tier's queue, needs one Redis
        raise ApiError("The Batch API needs a single Redis; this fleet runs on a Redis Cluster.",
                       code="not_implemented", status_code=501)  # fmt: skip
    store = file_store(tm)
    try:
        source = await find(store, body.input_file_id)
    except NotFound:
        raise BadRequest(f"Input file {body.input_file_id!r} was not found.",
                         param="input_file_id") from None  # fmt: skip
    if source.purpose != "batch":
        raise BadRequest(f"Input file {source.id!r} has purpose {source.purpose!r}; a batch's "
                         "input needs purpose 'batch'.", param="input_file_id")  # fmt: skip
    try:
        total = await asyncio.to_thread(_count_lines, store.path(source.id), body.endpoint,
                                        tm.settings.api.max_batch_requests)  # fmt: skip
    except FileNotFoundError:
        raise BadRequest(f"Input file {source.id!r} has no content.",
                         param="input_file_id") from None  # fmt: skip
    except LineError as e:
        raise BadRequest(f"Invalid input file {source.id!r}: {e}", param=e.param,
                         code="invalid_batch_line") from None  # fmt: skip
    if total == 0:
        raise BadRequest(f"Input file {source.id!r} holds no requests.", param="input_file_id")
    now = int(time.time())
    record = BatchRecord(
        id=batches.new_batch_id(),
        endpoint=body.endpoint,
        input_file_id=source.id,
        completion_window=body.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[body.completion_window],
        metadata=body.metadata,
        total=total,
    )
    try:
        await batches.create(tm.redis, tm.keys, record)
        await job_queue.enqueue_batch(tm.redis, tm.keys, record.id, record.attempt)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    return record.to_api()


async def _find(tm: TokenizerManager, batch_id: str) -> BatchRecord:
    try:
        record = await batches.get(tm.redis, tm.keys, batch_id)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    if record is None:
        raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
    return record


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, tm: TokenizerManagerDep) -> dict[str, Any]:
    return (await _find(tm, batch_id)).to_api()


@router.get("/v1/batches")
async def list_batches(
    tm: TokenizerManagerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    """Newest first; `after` is the last batch id of the previous page."""
    try:
        page, more = await batches.page(tm.redis, tm.keys, after, limit)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    data = [record.to_api() for record in page]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, tm: TokenizerManagerDep) -> dict[str, Any]:
    """validating | in_progress | finalizing -> cancelling; the jobs worker running it stops
    feeding, aborts its lines in flight, writes what finished and moves it to cancelled."""
    await _find(tm, batch_id)
    try:
        found = await batches.transition(tm.redis, tm.keys, batch_id, "cancelling")
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    if found is None:
        raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
    if not batches.moved(found, "cancelling") and found != "cancelling":
        raise ApiError(f"Cannot cancel a batch with status '{found}'.", status_code=409)
    return (await _find(tm, batch_id)).to_api()
