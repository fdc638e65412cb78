"""Streaming responses that outlive their client's connection (DESIGN §4.9).

A ResponsePump is the one producer of a streaming response: its own task renders the
request's outputs into SSE events, logs each event (api.event_log) before the client may see
it, and queues it for the HTTP side. The HTTP side (`sse_body`) only forwards queued events
(skipping ids the client already has). When the client goes away the pump goes on logging
for orphan_grace_s, waiting for a re-attach (GET /v1/requests/{rid}/stream on any replica),
then aborts what this attachment still owns. A pump whose request another attachment took
over ends quietly: no [DONE], no abort."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Protocol

from fastapi.responses import StreamingResponse

from api import sse
from api.aborts import Aborts
from api.event_log import EventLog, Lost
from api.host import Core
from api.renderers import Event, Renderer, make_renderer
from api.req_state import GenerateReq, ReqOutput, ReqState, Superseded
from api.stream_spec import StreamSetup, StreamSpec, new_attach_id
from api.waiting import Disconnectable

logger = logging.getLogger(__name__)


class Host(Core, Protocol):
    aborts: Aborts
    pumps: set[ResponsePump]

    async def generate(
        self,
        reqs: Sequence[GenerateReq],
        request: Disconnectable | None = None,
        stream: StreamSetup | None = None,
    ) -> AsyncGenerator[ReqOutput, None]: ...

    def event_log(self, rid: str, attach_id: str, next_id: int = 0) -> EventLog: ...


class ResponsePump:
    def __init__(
        self,
        tm: Host,
        renderer: Renderer,
        outputs: AsyncGenerator[ReqOutput, None] | None,
        log: EventLog,
        states: Sequence[ReqState],
        opening: bool = True,
    ) -> None:
        self.tm = tm
        self.renderer = renderer
        self.outputs = outputs or _no_outputs()
        self.log = log
        self.states = list(states)
        self.opening = opening
        self.queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self.finished = False
        self.detached = False
        self._task: asyncio.Task[None] | None = None
        self._grace: asyncio.Task[None] | None = None

    @property
    def rid(self) -> str:
        return self.log.rid

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"stream:{self.rid}")
        self.tm.pumps.add(self)

    async def _run(self) -> None:
        try:
            await self._produce()
        except Superseded:
            logger.info("rid=%s taken over by another attachment: stream ends here", self.rid)
        except Exception:
            logger.exception("stream rid=%s failed", self.rid)
        finally:
            self.finished = True
            self.queue.put_nowait(None)
            self.tm.pumps.discard(self)
            if self._grace is not None:
                self._grace.cancel()

    async def _produce(self) -> None:
        async with aclosing(self.outputs) as outputs:
            try:
                if self.opening:
                    await self._emit(self.renderer.opening())
                async for out in outputs:
                    await self._emit(self.renderer.render(out))
                await self._emit(self.renderer.closing())
            except Lost:  # hand over before the outputs close (which would abort them)
                logger.info("rid=%s taken over by another attachment: stream ends here", self.rid)
                for state in self.states:
                    self.tm.supersede(state)

    async def _emit(self, events: list[Event]) -> None:
        for item in await self.log.append(events):
            if not self.detached:
                self.queue.put_nowait(item)

    def detach(self) -> None:
        """The client went away: keep going (logging) for the grace, then abort."""
        if self.finished or self.detached:
            return
        self.detached = True
        grace = self.tm.settings.api.orphan_grace_s
        logger.info("client of rid=%s went away: kept %gs for a re-attach", self.rid, grace)
        self._grace = asyncio.get_running_loop().create_task(self._expire(grace))

    async def _expire(self, grace: float) -> None:
        await asyncio.sleep(grace)
        message = f"The client went away and did not re-attach within {grace:g} s."
        await self.tm.aborts.abort_unless_moved(self.states, message)

    async def release(self) -> None:
        """Shutdown: leave the requests running, held by this (soon dead) replica, for a
        re-attach elsewhere or the orphan reaper; end the client's stream without [DONE]."""
        for state in self.states:
            state.released = True
        for task in (self._grace, self._task):
            if task is not None:
                task.cancel()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=1.0)


async def _no_outputs() -> AsyncGenerator[ReqOutput, None]:
    return
    yield  # an async generator with nothing in it


async def sse_body(
    pump: ResponsePump, request: Disconnectable | None, replay: list[bytes], after: int
) -> AsyncIterator[bytes]:
    """The HTTP side: `replay` (logged events), then the pump's events with ids > after.
    However it ends (client gone, cancelled), the pump is told, and goes on alone."""
    # Polled only where the server does not watch for it (Starlette cancels this body on a
    # disconnect itself below ASGI 2.4): a poll per idle stream was the api's largest cost
    # at thousands of slow streams.
    check_s = pump.tm.settings.api.disconnect_check_s
    poll = request if request is not None and not sse.server_watches_disconnect(request) else None
    try:
        for data in replay:
            yield data
        while True:
            if poll is None:
                item = await pump.queue.get()
            else:
                try:
                    async with asyncio.timeout(check_s):
                        item = await pump.queue.get()
                except TimeoutError:
                    if await poll.is_disconnected():
                        return
                    continue
            if item is None:
                return
            event_id, data = item
            if event_id > after:
                yield data
    finally:
        pump.detach()


async def stream_response(
    tm: Host, reqs: list[GenerateReq], spec: StreamSpec, request: Disconnectable
) -> StreamingResponse:
    """Submit a streaming request and answer it with its SSE stream (errors before the
    submission raise as usual)."""
    setup = StreamSetup(spec, new_attach_id(tm.api_id))
    outputs = await tm.generate(reqs, None, setup)
    renderer = make_renderer(spec, tm.tok.token_texts)
    pump = ResponsePump(tm, renderer, outputs, tm.event_log(setup.stream_rid, setup.attach_id),
                        setup.states)  # fmt: skip
    pump.start()
    return sse.response(sse_body(pump, request, [], -1))
