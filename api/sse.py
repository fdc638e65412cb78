"""Server-sent events: `data: {json}\n\n` chunks and the `data: [DONE]\n\n` terminator (each sent
after its `id: N` line, which api.event_log adds when it logs the event)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

from api.errors import ClientDisconnected

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    """One SSE event; `payload` is JSON text/bytes or an object msgspec can encode."""
    if isinstance(payload, str):
        payload = payload.encode()
    elif not isinstance(payload, bytes):
        payload = msgspec.json.encode(payload)
    return b"data: " + payload + b"\n\n"


async def _until_disconnect(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except ClientDisconnected:
        return  # nobody is listening: not even [DONE]


def server_watches_disconnect(request: object) -> bool:
    """Whether a disconnect cancels the response without our polling: Starlette's
    StreamingResponse listens for it itself when the server speaks ASGI below 2.4 (uvicorn
    says 2.3); from 2.4 on it learns of it only when a send fails."""
    scope = getattr(request, "scope", None)
    if not isinstance(scope, dict):
        return False
    version = scope.get("asgi", {}).get("spec_version", "2.0")
    try:
        return tuple(int(part) for part in str(version).split(".")) < (2, 4)
    except ValueError:
        return False


def response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        _until_disconnect(chunks),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
