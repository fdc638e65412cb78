"""Embeddings: SGLang's POST /encode and OpenAI's POST /v1/embeddings. Each input becomes an
embedding job (prefill only, max_new_tokens 0); the engine's pooled last hidden state comes
back on the request's final entry. Cross-encoder pairs [[query, doc], ...] are tokenized as
pairs (with token_type_ids)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from api.deps import TokenizerManagerDep
from api.errors import ApiError, BadRequest
from api.inputs import embed_prompts, embed_reqs, raise_for_error
from api.req_state import ReqOutput
from api.routes.common import collect, make_router
from api.schemas.native import EncodeRequest
from api.schemas.openai import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)

router = make_router("embeddings")


def _embedding(out: ReqOutput) -> list[float]:
    emb = out.embedding
    if emb is None:
        raise ApiError(f"The engine returned no embedding for request {out.rid}.", status_code=500)
    if not all(math.isfinite(x) for x in emb):
        raise ApiError(
            f"The engine returned a non-finite embedding for {out.rid}.", status_code=500
        )
    return emb


async def _run(
    tm: TokenizerManagerDep, request: Request, value: Any, rid: Any, openai: bool, priority: int
) -> tuple[list[ReqOutput], bool]:
    prompts, is_single = embed_prompts(value)
    reqs = embed_reqs(prompts, rid, openai=openai, priority=priority)
    results = await collect(await tm.generate(reqs, request))
    raise_for_error(results)
    return results, is_single


@router.post("/encode", response_model=None)
@router.put("/encode", response_model=None, include_in_schema=False)
async def encode(body: EncodeRequest, request: Request, tm: TokenizerManagerDep) -> Response:
    """SGLang's embedding route: {embedding, meta_info}, or a list of them for a batch."""
    if body.text is not None and body.input_ids is not None:
        raise BadRequest("Only one of text or input_ids should be provided.")
    value = body.text if body.text is not None else body.input_ids
    if value is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    results, is_single = await _run(tm, request, value, body.rid, False, body.priority or 0)
    payload = [{"embedding": _embedding(out), "meta_info": out.meta_info()} for out in results]
    return JSONResponse(payload[0] if is_single else payload)


@router.post("/v1/embeddings", response_model=None, responses={200: {"model": EmbeddingResponse}})
async def create_embeddings(
    body: EmbeddingRequest, request: Request, tm: TokenizerManagerDep
) -> Response:
    """OpenAI embeddings: one `data` item per input, floats or base64 float32."""
    if body.dimensions is not None:
        raise BadRequest(
            "This model does not support the dimensions parameter.", param="dimensions"
        )
    results, _ = await _run(tm, request, body.input, body.rid, True, body.priority or 0)
    data = [
        EmbeddingData(index=out.index, embedding=_encode(_embedding(out), body.encoding_format))
        for out in results
    ]
    prompt_tokens = sum(out.prompt_tokens for out in results)
    response = EmbeddingResponse(
        data=data,
        model=tm.model.served_model_name,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()
    return embedding
