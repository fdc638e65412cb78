"""Waiting for a request's outputs (SGLang's _wait_one_response): the listener sets a
state's event, the waiter drains it. Between outputs the waiter checks, every
disconnect_check_s, whether the client went away (non-streaming requests: an abort), whether
the request timed out (504), whether a gap waits for its refill, and whether another
attachment took the request over (it then ends quietly with Superseded)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Protocol

from api.aborts import Aborts
from api.errors import ClientDisconnected
from api.gaps import GapFiller
from api.host import Core
from api.logprobs import needed_token_ids
from api.req_state import ReqOutput, ReqState, Superseded
from shared import deadlines

logger = logging.getLogger(__name__)


class Disconnectable(Protocol):
    async def is_disconnected(self) -> bool: ...


class Host(Core, Protocol):
    gaps: GapFiller
    aborts: Aborts


# A request with no news for this long is looked at (resend, then its durable state): longer
# than a step, shorter than a detokenizer's shards take to move (lease TTL + a tick).
STALL_S = 3.0


async def wait_one(
    tm: Host, state: ReqState, request: Disconnectable | None
) -> AsyncGenerator[ReqOutput, None]:
    """A request's outputs: every update when streaming, else only the final one."""
    check_s = tm.settings.api.disconnect_check_s
    last_check = time.monotonic()
    while True:
        try:
            async with asyncio.timeout(check_s):  # no task per wait, as wait_for makes
                await state.event.wait()
        except TimeoutError:
            await check_alive(tm, state, request)
            last_check = time.monotonic()
            continue
        state.event.clear()
        if state.superseded:
            raise Superseded(state.rid)
        if state.finished:
            yield await _ready(tm, state.take_output())
            return
        if state.obj.stream:
            yield await _ready(tm, state.take_output())
        if time.monotonic() - last_check >= check_s:
            await check_alive(tm, state, request)
            last_check = time.monotonic()


async def _ready(tm: Host, out: ReqOutput) -> ReqOutput:
    """Decode (off the loop) the token texts that the output's logprobs will show."""
    req = out.req
    if out.logprobs is not None and (req.return_text_in_logprobs or req.openai):
        await tm.tok.ensure_token_texts(needed_token_ids(out))
    return out


async def check_alive(
    tm: Host, state: ReqState, request: Disconnectable | None
) -> None:
    if state.superseded:
        raise Superseded(state.rid)
    if request is not None and await request.is_disconnected():
        logger.info("client disconnected rid=%s", state.rid)
        raise ClientDisconnected(f"Request is disconnected from the client side: {state.rid}")
    idle = time.monotonic() - state.last_time
    if idle > STALL_S and not (state.held or state.resend_at or state.finished):
        # Its last entries may have gone to a shard nobody served (a detokenizer died just
        # then): nothing else would come. Ask for a resend, then refill from rs:ids.
        tm.gaps.request([state])
    if state.held or state.resend_at:
        await tm.gaps.check(state)
    if idle > tm.settings.api.request_timeout_s and not state.finished:
        logger.warning("no output for %.0fs rid=%s: aborting", idle, state.rid)
        message = f"No output for {idle:.0f} s; the request timed out."
        await tm.aborts.abort_and_finish([state.rid], message, 504)
    elif past_deadline(state):
        logger.warning("rid=%s past its timeout of %gs: aborting", state.rid, state.obj.timeout)
        message = deadlines.message(state.obj.timeout or 0.0)
        await tm.aborts.abort_and_finish([state.rid], message, deadlines.DEADLINE_STATUS)


def past_deadline(state: ReqState) -> bool:
    """Whether the request's `timeout` passed (plus a grace in which the scheduler's own end
    of it, with the output so far, is expected to arrive first)."""
    timeout = state.obj.timeout
    if not timeout or state.finished:
        return False
    return time.time() >= state.created_time + timeout + deadlines.API_GRACE_S


async def wait_batch(
    tm: Host, states: list[ReqState], request: Disconnectable | None
) -> AsyncGenerator[ReqOutput, None]:
    """A batch's outputs: streaming, as each becomes ready; else the finals in batch order."""
    gens = [wait_one(tm, s, request) for s in states]
    if not states[0].obj.stream:
        tasks = [asyncio.ensure_future(last(g)) for g in gens]
        try:
            for out in await asyncio.gather(*tasks):
                yield out
        finally:
            for task in tasks:
                task.cancel()
        return
    pending = {asyncio.ensure_future(anext(g)): g for g in gens}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                gen = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield out
                pending[asyncio.ensure_future(anext(gen))] = gen
    finally:
        for task in pending:
            task.cancel()


async def last(gen: AsyncGenerator[ReqOutput, None]) -> ReqOutput:
    final: ReqOutput | None = None
    async for out in gen:
        final = out
    assert final is not None, "a waiter ended without a terminal output"
    return final
