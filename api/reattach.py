"""Re-attaching to a streaming response on ANY replica (DESIGN §4.9):
GET /v1/requests/{rid}/stream replays the response's logged events after Last-Event-ID, byte
for byte under the same ids, then goes on live to [DONE] with no gap and no duplicate.

A finished response (its log ends with [DONE]) is only replayed. Otherwise this replica
takes the response over, whoever held it (a dead replica, a live one whose client left, or
this one): one compare-and-set moves the attachment, the members' api_id and the held-rid set
entries here and returns the log as of that moment (shared.reattach.take_over); the former
holder can append nothing after it. The renderer and each unfinished member's state are
rebuilt from the log's marks, a Reattach asks the detokenizer to route the members' text here
and to send it again from the seq after the last logged event, and a new pump goes on.

A batch (or n > 1) response has one log, under its first rid; any member's rid finds it, as
do the client's base rid and the OpenAI response id (`cmpl-…`, `chatcmpl-…`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi.responses import StreamingResponse

from api import sse
from api.errors import NotFound, ServiceUnavailable
from api.event_log import EventRecord, decode_records, frame
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.renderers import Mark, Renderer, make_renderer
from api.req_state import ReqState
from api.stream_spec import StreamSpec, new_attach_id
from api.streams import ResponsePump, sse_body
from api.tokenizer_manager import SHUTTING_DOWN, TokenizerManager
from api.waiting import Disconnectable
from shared import protocol, reattach, request_state

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TAKEOVER_ATTEMPTS = 3
_TERMINAL = ("finished", "aborted")


@dataclass
class Target:
    """A streaming response as Redis has it."""

    stream_rid: str
    spec: StreamSpec
    api_id: str
    attach_id: str
    infos: list[protocol.RequestState | None]  # per member
    records: list[EventRecord]


async def open_stream(
    tm: TokenizerManager, rid: str, after: int, request: Disconnectable
) -> StreamingResponse:
    """The SSE response of a re-attach: replay after event id `after`, then live."""
    if tm.draining:
        raise ServiceUnavailable(SHUTTING_DOWN)
    for _ in range(_TAKEOVER_ATTEMPTS):
        target = await _guarded(find(tm, rid))
        if target.records and target.records[-1].is_final:
            logger.info("replaying finished rid=%s after event %d", target.stream_rid, after)
            sent = make_renderer(target.spec, tm.tok.token_texts).expand(target.records)
            return sse.response(_replay(sent, after))
        attach_id = new_attach_id(tm.api_id)
        new = (tm.api_id, attach_id)
        old = (target.api_id, target.attach_id)
        snapshot = await _guarded(reattach.take_over(tm.redis, tm.keys, target.spec.rids, old, new))
        if snapshot is not None:
            target.records = decode_records(snapshot)
            texts = await _guarded(_parsed_texts(tm, target))
            pump, sent = _resume(tm, target, attach_id, texts)
            frames = [frame(i, data) for i, data in enumerate(sent) if i > after]
            return sse.response(sse_body(pump, request, frames, after))
    raise ServiceUnavailable("The stream is being re-attached elsewhere; try again.")


async def find(tm: TokenizerManager, rid: str) -> Target:
    """The streaming response that `rid` (a member, base or response id) belongs to."""
    info, found = None, rid
    for found in _candidates(rid):
        info = await request_state.read(tm.redis, tm.keys, found)
        if info is not None:
            break
    if info is None:
        raise NotFound(f"Request {rid} was not found (unknown, or expired).", param="rid",
                       code="request_not_found")  # fmt: skip
    if info.stream_rid is None:
        raise NotFound(f"Request {rid} has no event stream (it was not a streaming request).",
                       param="rid", code="stream_not_found")  # fmt: skip
    head = info if info.stream_rid == found else await request_state.read(
        tm.redis, tm.keys, info.stream_rid
    )
    if head is None or head.stream_spec is None or head.attach_id is None:
        raise NotFound(f"The stream of request {rid} expired.", param="rid",
                       code="request_not_found")  # fmt: skip
    spec = StreamSpec.decode(head.stream_spec)
    infos = [await request_state.read(tm.redis, tm.keys, r) for r in spec.rids]
    raw = await reattach.read_events(tm.redis, tm.keys, info.stream_rid)
    return Target(info.stream_rid, spec, head.api_id or "", head.attach_id, infos,
                  decode_records(raw))  # fmt: skip


def _candidates(rid: str) -> list[str]:
    base = rid
    for prefix in ("chatcmpl-", "cmpl-"):
        base = base.removeprefix(prefix)
    names = [rid, base, f"{base}-0", f"{base}_0"]
    return list(dict.fromkeys(names))


async def _guarded(call: Awaitable[T]) -> T:
    """A Redis call of the re-attach, bounded; a failure is the client's 503."""
    try:
        async with asyncio.timeout(2 * REDIS_TIMEOUT_S):
            return await call
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e


async def _replay(sent: list[bytes], after: int) -> AsyncIterator[bytes]:
    for i, data in enumerate(sent):
        if i > after:
            yield frame(i, data)


async def _parsed_texts(tm: TokenizerManager, target: Target) -> dict[int, str]:
    """A chat stream whose text goes through parsers (tool calls, reasoning): each live
    member's text up to its last logged event, from the id log, so that the new renderer's
    parsers hold what the old one held back (a call begun but not finished)."""
    spec = target.spec
    if spec.kind != "chat" or not (spec.tool_parser or spec.reasoning_parser):
        return {}
    marks = {r.mark.index: r.mark for r in target.records if r.mark is not None}
    texts = {}
    for index, mark in marks.items():
        if not mark.done:
            member = spec.members[index]
            ids = (await request_state.output_ids(tm.redis, tm.keys, member.rid))[: mark.seq]
            [texts[index]] = await tm.tok.decode_batch([ids], member.skip_special_tokens)
    return texts


def _resume(
    tm: TokenizerManager, target: Target, attach_id: str, texts: dict[int, str]
) -> tuple[ResponsePump, list[bytes]]:
    """Rebuild the renderer and the unfinished members' states from the log and go on;
    returns the new pump and the logged events as they were sent."""
    spec, records = target.spec, target.records
    renderer = make_renderer(spec, tm.tok.token_texts)
    sent = renderer.expand(records)
    marks, data = _last_marks(records, sent)
    renderer.restore(marks)
    for index, text in texts.items():
        renderer.seed_text(index, text)
    states = [
        _seed(renderer, target, i, marks.get(i), data.get(i), attach_id)
        for i in range(len(spec.members))
        if not (i in marks and marks[i].done)
    ]
    log = tm.event_log(target.stream_rid, attach_id, next_id=len(records))
    outputs = None
    if states:
        tm.adopt(states)
        outputs = tm.outputs(states)
        tm.gaps.request(states, lost=True)  # routes their text here, sent again from their seq
        for state in states:
            info = target.infos[state.index]
            if info is not None and info.status in _TERMINAL:
                tm.gaps.refill_soon(state)  # it ended meanwhile: from the id log, now
    logger.info("re-attached rid=%s (%d members live) from %s at event %d", target.stream_rid,
                len(states), target.api_id, len(records))  # fmt: skip
    pump = ResponsePump(tm, renderer, outputs, log, states, opening=not records)
    pump.start()
    return pump, sent


def _last_marks(
    records: list[EventRecord], sent: list[bytes]
) -> tuple[dict[int, Mark], dict[int, bytes]]:
    """Each member's last mark and the event (as sent) that carried it."""
    marks: dict[int, Mark] = {}
    data: dict[int, bytes] = {}
    for record, event in zip(records, sent, strict=True):
        if record.mark is not None:
            marks[record.mark.index] = record.mark
            data[record.mark.index] = event
    return marks, data


def _seed(
    renderer: Renderer,
    target: Target,
    index: int,
    mark: Mark | None,
    data: bytes | None,
    attach_id: str,
) -> ReqState:
    spec = target.spec
    member = spec.members[index]
    state = ReqState(obj=spec.member_req(index), index=index, prompt_tokens=member.prompt_tokens,
                     created_time=spec.created_time)  # fmt: skip
    state.stream_rid, state.attach_id = target.stream_rid, attach_id
    info = target.infos[index]
    state.epoch = info.epoch if info is not None and info.epoch is not None else 0
    if mark is not None and data is not None:
        state.next_seq = state.last_output_offset = mark.seq
        state.completion_tokens = mark.completion_tokens
        state.num_outputs = 1
        state.output_ids = [0] * mark.seq  # never shown again (deltas); or seeded below
        if state.logprobs is not None:
            state.logprobs.extend(None, mark.seq)
        renderer.seed(state, data)
    return state
