"""Whether this replica can serve: the reasons behind /health and /health_generate.

- liveness (`/live`, `redserve health api`): the replica runs, is not draining, its result
  channel is subscribed and Redis answers;
- readiness (`/health`): that, and at least one scheduler is ready (a live beat in a serving
  state: its model loaded, taking jobs);
- `/health_generate`: that, and one real token goes through the whole fleet (api → stream →
  scheduler → detokenizer → api) within `api.health_generate_timeout_s`.
Each answers None when all is well, else the reason a 503 gives."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing

from api.errors import ApiError
from api.metrics import HEALTH_CHECK_PREFIX
from api.redis_errors import REDIS_ERRORS
from api.req_state import GenerateReq
from api.tokenizer_manager import HEALTH_TIMEOUT_S, SHUTTING_DOWN, TokenizerManager
from shared import heartbeat, protocol
from shared.heartbeat import SERVING_STATES, SchedulerBeat


async def not_live(tm: TokenizerManager) -> str | None:
    if tm.draining:
        return SHUTTING_DOWN
    if not await tm.is_healthy():
        return "Redis is unreachable or the result channel is not subscribed."
    return None


async def not_ready(tm: TokenizerManager) -> str | None:
    reason, _beats = await _readiness(tm)
    return reason


async def _readiness(tm: TokenizerManager) -> tuple[str | None, dict[str, SchedulerBeat]]:
    """(why not ready, or None; the live schedulers' beats)."""
    if reason := await not_live(tm):
        return reason, {}
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            beats = await heartbeat.live_scheduler_beats(tm.redis, tm.keys)
    except REDIS_ERRORS:
        return "Redis is unreachable.", {}
    if any(beat.state in SERVING_STATES for beat in beats.values()):
        return None, beats
    return no_scheduler_reason(beats), beats


def no_scheduler_reason(beats: dict[str, SchedulerBeat]) -> str:
    """Why none of `beats` can serve (none alive, loading, updating, draining)."""
    if not beats:
        return "No scheduler is running."
    states = "; ".join(
        f"{worker_id} is {beat.state}" + (f" ({beat.progress})" if beat.progress else "")
        for worker_id, beat in sorted(beats.items())
    )
    return f"No scheduler is ready: {states}."


async def not_generating(tm: TokenizerManager) -> str | None:
    """Readiness, then one greedy token from a one-token prompt through the fleet (not while
    every scheduler is paused: it would only wait)."""
    why, beats = await _readiness(tm)
    if why:
        return why
    if all(beat.state == "paused" for beat in beats.values() if beat.state in SERVING_STATES):
        return "Generation is paused (POST /continue_generation resumes it)."
    timeout_s = tm.settings.api.health_generate_timeout_s
    req = GenerateReq(
        rid=f"{HEALTH_CHECK_PREFIX}{uuid.uuid4().hex}",
        prompt=[0],
        sampling=protocol.SamplingParams(max_new_tokens=1, temperature=0.0),
        max_new_tokens=1,
    )
    try:
        async with asyncio.timeout(timeout_s):
            async with aclosing(await tm.generate([req])) as outputs:
                results = [out async for out in outputs]
    except TimeoutError:  # leaving the generator aborts the request
        return f"No token came back through the fleet within {timeout_s:g} s."
    except ApiError as e:
        return e.message
    finish = results[-1].finish_reason if results else None
    if finish is None or finish.type == "abort":
        return f"The health check request failed: {finish.message if finish else 'no output'}"
    return None
