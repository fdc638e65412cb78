"""SGLang-native routes: /generate, /abort_request, /health, /get_model_info."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api import sse
from api.deps import ModelDep, TokenizerManagerDep
from api.errors import ServiceUnavailable
from api.inputs import native_reqs, raise_for_error
from api.req_state import ReqOutput
from api.routes.common import collect, stream_outputs
from api.schemas.native import AbortRequestIn, GenerateRequest

logger = logging.getLogger(__name__)

router = APIRouter(tags=["native"])


@router.post("/generate", response_model=None)
@router.put("/generate", response_model=None, include_in_schema=False)
async def generate(body: GenerateRequest, request: Request, tm: TokenizerManagerDep) -> Response:
    """Generate from `text` or `input_ids` (single or batch); SSE when `stream` is true."""
    reqs, is_single = native_reqs(body)
    outputs = await tm.generate(reqs, request)
    if body.stream:
        return sse.response(_stream(outputs, is_single))
    results = await collect(outputs)
    raise_for_error(results)
    payload = [out.to_dict() for out in results]
    return JSONResponse(payload[0] if is_single else payload)


async def _stream(
    outputs: AsyncGenerator[ReqOutput, None], is_single: bool
) -> AsyncIterator[bytes]:
    # Chunks carry the cumulative text and output_ids (SGLang's default streaming output).
    async for out in stream_outputs(outputs):
        chunk = out.to_dict()
        if not is_single:
            chunk["index"] = out.index
        yield sse.event(chunk)
    yield sse.DONE


@router.post("/abort_request")
async def abort_request(body: AbortRequestIn, tm: TokenizerManagerDep) -> Response:
    """Abort one request by rid (on any replica), or every request of this replica."""
    if body.abort_all:
        await tm.abort_all()
    elif body.rid:
        await tm.abort_request([body.rid])
    return Response(status_code=200)


@router.get("/health")
@router.get("/health_generate")
async def health(tm: TokenizerManagerDep) -> Response:
    """200 when Redis answers and the result channel is subscribed, else 503."""
    if await tm.is_healthy():
        return Response(status_code=200)
    raise ServiceUnavailable("Redis is unreachable or the result channel is not subscribed.")


@router.get("/get_model_info")
async def get_model_info(model: ModelDep) -> dict[str, Any]:
    """The served model (SGLang's fields plus context length and vocabulary size)."""
    return {
        "model_path": model.model_path,
        "tokenizer_path": model.resolved_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "served_model_name": model.served_model_name,
        "context_length": model.context_length,
        "vocab_size": model.vocab_size,
        "model_type": model.model_type,
        "architectures": list(model.architectures),
    }
