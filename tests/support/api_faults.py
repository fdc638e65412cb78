"""The api under faults, in process: an SSE client that reads a stream as it comes (and can
go away mid-stream), and `freeze`, which makes a running replica stop as a kill -9 would
(no more heartbeat, nothing received, no cleanup written)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import FastAPI

from shared import heartbeat


class SseClient:
    """One HTTP request through an ASGI app by hand, its SSE body parsed as it arrives."""

    def __init__(self, app: FastAPI, spec_version: str = "2.3") -> None:
        self.app = app
        self.spec_version = spec_version
        self.status: int | None = None
        self.raw = b""
        self.done = asyncio.Event()
        self.disconnect = asyncio.Event()
        self._grew = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> SseClient:
        self._task = asyncio.create_task(self._run(method, path, body, headers or {}))
        return self

    async def _run(self, method: str, path: str, body: Any, headers: dict[str, str]) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await self.disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if self.disconnect.is_set():
                if self.spec_version >= "2.4":
                    raise OSError("client went away")
                return
            if message["type"] == "http.response.start":
                self.status = message["status"]
            self.raw += message.get("body", b"")
            self._grew.set()

        raw_headers = [(b"host", b"test")]
        if body is not None:
            raw_headers.append((b"content-type", b"application/json"))
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": self.spec_version},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": raw_headers, "server": ("test", 80), "client": ("127.0.0.1", 5000),
        }  # fmt: skip
        try:
            await self.app(scope, receive, send)
        finally:
            self.done.set()
            self._grew.set()

    @property
    def frames(self) -> list[tuple[int, str]]:
        """(id, data) of every complete event so far."""
        out = []
        for event in self.raw.decode().split("\n\n")[:-1]:
            head, _, data = event.partition("\ndata: ")
            out.append((int(head.removeprefix("id: ")), data))
        return out

    async def wait_events(self, n: int, timeout: float = 5.0) -> list[tuple[int, str]]:
        async with asyncio.timeout(timeout):
            while len(self.frames) < n and not self.done.is_set():
                self._grew.clear()
                await self._grew.wait()
        assert len(self.frames) >= n, (self.status, self.raw)
        return self.frames

    async def finished(self, timeout: float = 5.0) -> bytes:
        await asyncio.wait_for(self.done.wait(), timeout)
        return self.raw

    async def leave(self) -> None:
        """The client goes away."""
        self.disconnect.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)


async def freeze(app: FastAPI) -> None:
    """Make a replica stop as after kill -9: no beat (its key gone as if it expired), no
    subscription, its streams' tasks gone, nothing written on the way out."""
    tm = app.state.manager
    task = tm.maintenance._task  # the upkeep task: a dead process beats no more
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        tm.maintenance._task = None
    await tm.listener.stop()
    for pump in list(tm.pumps):
        await pump.release()
    tm.rid_to_state.clear()
    await tm.redis.delete(tm.keys.heartbeat(heartbeat.API, tm.api_id))


def text_of(
    kind: str, frames: list[tuple[int, str]], index: int = 0, cumulative: bool = True
) -> str:
    """The text a client reads from a stream's frames, for one choice / batch item
    (/generate chunks are cumulative unless the replica streams deltas)."""
    out = ""
    for _id, data in frames:
        if data == "[DONE]" or data.startswith('{"error"'):
            continue
        chunk = json.loads(data)
        if kind == "generate":
            if chunk.get("index", 0) == index:
                out = chunk["text"] if cumulative else out + chunk["text"]
            continue
        for choice in chunk["choices"]:
            if choice["index"] == index:
                out += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return out
