"""The generate -> stream or collect -> answer flow that /v1/chat/completions and
/v1/completions share: streams are rendered by api.renderers from the response's StreamSpec
(so that any replica can go on rendering them after a re-attach); otherwise `answer` builds
one JSON body once every output finished."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request, Response
from pydantic import BaseModel

from api.inputs import raise_for_error
from api.renderers import OpenAIHead
from api.req_state import GenerateReq, ReqOutput
from api.routes.common import collect
from api.schemas.openai import OpenAISamplingRequest
from api.stream_spec import Kind, StreamSpec
from api.streams import stream_response
from api.tokenizer_manager import TokenizerManager


async def respond(
    tm: TokenizerManager,
    reqs: list[GenerateReq],
    request: Request,
    body: OpenAISamplingRequest,
    spec: StreamSpec,
    answer: Callable[[list[ReqOutput]], BaseModel],
) -> Response:
    """SSE chunks (with continuous usage, the final usage chunk, [DONE]) when streaming;
    else the whole body that `answer` builds from the final outputs."""
    if body.stream:
        return await stream_response(tm, reqs, spec, request)
    results = await collect(await tm.generate(reqs, request))
    raise_for_error(results)
    return Response(answer(results).model_dump_json(), media_type="application/json")


def openai_spec(kind: Kind, head: OpenAIHead, n: int, body: OpenAISamplingRequest) -> StreamSpec:
    """The stream spec of an OpenAI request; `n`: samples per prompt, for usage."""
    return StreamSpec(
        kind=kind,
        n=n,
        head_id=head.id,
        created=head.created,
        model=head.model,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )
