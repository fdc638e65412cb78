"""The request-state hash (shared/request_state.py): what each writer sets, decoded back into
protocol.RequestState in the one place that reads it."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import protocol, request_state
from shared.keys import Keys


async def _run(r: aioredis.Redis, *steps: object) -> None:
    pipe = r.pipeline(transaction=True)
    for step in steps:
        assert callable(step)
        step(pipe)
    await pipe.execute()


async def test_each_writer_s_fields_read_back_typed(fake_redis: aioredis.Redis, keys: Keys) -> None:
    assert await request_state.read(fake_redis, keys, "r1") is None
    await _run(fake_redis, lambda p: request_state.create(p, keys, "r1", "api-1", 7))
    state = await request_state.read(fake_redis, keys, "r1")
    assert state is not None and (state.status, state.api_id) == ("queued", "api-1")
    assert (state.prompt_tokens, state.completion_tokens, state.worker) == (7, 0, None)
    assert state.created_at is not None and state.created_at > 0 and state.finish_reason is None

    await _run(fake_redis, lambda p: request_state.mark_running(p, keys, "r1", "w1", 2))
    state = await request_state.read(fake_redis, keys, "r1")
    assert state is not None and (state.status, state.worker, state.epoch) == ("running", "w1", 2)

    reason = protocol.FinishReason(type="length", length=5)
    await _run(fake_redis, lambda p: request_state.finish(p, keys, "r1", reason, 5, 3))
    state = await request_state.read(fake_redis, keys, "r1")
    assert state is not None and state.status == "finished" and state.finish_reason == reason
    assert (state.completion_tokens, state.cached_tokens) == (5, 3)
    assert state.finished_at is not None and state.finished_at >= state.created_at


def test_an_abort_is_status_aborted_and_unknown_fields_are_ignored() -> None:
    stored = {"status": "aborted", "finish_reason": '{"type":"abort"}', "later_field": "x"}
    state = request_state.decode(stored)
    assert state == protocol.RequestState(
        status="aborted", finish_reason=protocol.FinishReason(type="abort")
    )
    assert request_state.decode({}) is None
