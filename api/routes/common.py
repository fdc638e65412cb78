"""Helpers shared by the routes: draining a request's outputs, OpenAI response heads, usage."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter

from api.jsonbody import JsonRoute
from api.req_state import ReqOutput
from api.schemas.openai import UsageInfo


def make_router(tag: str) -> APIRouter:
    """A router whose routes read bodies as strict JSON (api.jsonbody)."""
    return APIRouter(tags=[tag], route_class=JsonRoute)


async def collect(outputs: AsyncGenerator[ReqOutput, None]) -> list[ReqOutput]:
    """All outputs of a non-streaming request (one final output per prompt, in order)."""
    async with aclosing(outputs):
        return [out async for out in outputs]


async def stream_outputs(outputs: AsyncGenerator[ReqOutput, None]) -> AsyncIterator[ReqOutput]:
    """Outputs for an SSE stream. The iterator is always closed, which aborts what has not
    finished (client gone, generator cancelled). A detected disconnect raises
    ClientDisconnected, which `sse.response` turns into a quiet end of the stream."""
    async with aclosing(outputs):
        async for out in outputs:
            yield out


@dataclass
class OpenAIHead:
    """The id/created/model triple of every OpenAI response and chunk."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def usage_of(outputs: list[ReqOutput], n: int = 1) -> UsageInfo:
    """Usage of a request's outputs; with n samples per prompt a prompt counts once."""
    prompt = sum(o.prompt_tokens for o in outputs if o.index % n == 0)
    completion = sum(o.completion_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
