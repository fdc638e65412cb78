"""Drive one HTTP request through an ASGI app by hand, so a test can make the client
disconnect mid-request (httpx's ASGITransport buffers whole responses and never does)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI


class ManualClient:
    def __init__(self, app: FastAPI, spec_version: str = "2.3") -> None:
        self.app = app
        self.spec_version = spec_version
        self.messages: list[dict[str, Any]] = []
        self.disconnect = asyncio.Event()
        self.got_body = asyncio.Event()

    @property
    def status(self) -> int | None:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if "body" in m)

    async def post(self, path: str, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
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
                if self.spec_version >= "2.4":  # 2.4 servers raise; uvicorn (2.3) drops it
                    raise OSError("client went away")
                return
            self.messages.append(message)
            if message.get("body"):
                self.got_body.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": self.spec_version},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "server": ("test", 80),
            "client": ("127.0.0.1", 5000),
        }
        await self.app(scope, receive, send)
