"""Helpers shared by the routes: routers that read strict JSON, draining a request's outputs."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter

from api.jsonbody import JsonRoute
from api.req_state import ReqOutput


def make_router(tag: str) -> APIRouter:
    """A router whose routes read bodies as strict JSON (api.jsonbody)."""
    return APIRouter(tags=[tag], route_class=JsonRoute)


async def collect(outputs: AsyncGenerator[ReqOutput, None]) -> list[ReqOutput]:
    """All outputs of a non-streaming request (one final output per prompt, in order)."""
    async with aclosing(outputs):
        return [out async for out in outputs]
