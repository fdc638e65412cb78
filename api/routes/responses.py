"""OpenAI's Responses API: POST /v1/responses (text, function tools, text.format, streaming
events), answered through the chat pipeline (api.responses). Stateless; `n` is 1."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from api.deps import TokenizerManagerDep
from api.inputs import raise_for_error
from api.req_state import ReqOutput
from api.responses import (
    ResponseEvents,
    chat_request,
    output_items,
    response_object,
    status_of,
    usage,
)
from api.routes.chat import prepare_chat
from api.routes.common import collect, make_router
from api.schemas.responses import ResponsesRequest

router = make_router("openai")


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, request: Request, tm: TokenizerManagerDep
) -> Response:
    """Answer `input` (a text or the conversation's items) as a Response object or events."""
    chat = await prepare_chat(chat_request(body), tm)
    resp_id, model = f"resp_{chat.base}", tm.model.served_model_name
    if body.stream:
        events = ResponseEvents(body, resp_id, model, chat.base, chat.tools.parser,
                                chat.thinking)  # fmt: skip
        outputs = await tm.generate(chat.reqs, request)
        return StreamingResponse(_sse(events, outputs), media_type="text/event-stream")
    [out] = await collect(await tm.generate(chat.reqs, request))
    raise_for_error([out])
    reasoning, content, calls = chat.parse(out)
    body_out = response_object(
        body, resp_id, int(time.time()), model, output_items(chat.base, reasoning, content, calls),
        status_of(out.finish_reason), out.finish_reason, _usage(out),
    )  # fmt: skip
    return Response(json.dumps(body_out), media_type="application/json")


def _usage(out: ReqOutput) -> dict[str, Any]:
    return usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


async def _sse(events: ResponseEvents, outputs: Any) -> AsyncIterator[bytes]:
    """`event: <type>` + `data: {json}` per event; closing early aborts the request."""
    for event in events.opening():
        yield _frame(event)
    async with aclosing(outputs):
        async for out in outputs:
            new, calls = events.delta(out.delta, out.finished)
            for event in new:
                yield _frame(event)
            if out.finished:
                for event in events.closing(calls, out.finish_reason, _usage(out)):
                    yield _frame(event)


def _frame(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

