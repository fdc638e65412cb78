"""A planned stop of an api replica (DESIGN §4.10). uvicorn's own SIGTERM handling closes the
listening socket first, so a load balancer would see refused connections while requests still
run. DrainingServer puts a drain step before it: on the first SIGTERM/SIGINT the replica
answers /health and new requests with 503 (the socket stays open), waits up to drain_s for
the requests in flight to finish, then hands the rest over (streams released for a re-attach
elsewhere, other requests aborted with a 503) and only then lets uvicorn shut down. A second
signal skips the wait."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_s = drain_s
        self.drain_requested = False
        self.draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler (it runs on the event loop's thread, between steps)."""
        manager = getattr(self.app.state, "manager", None)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if self.drain_requested or manager is None or loop is None:
            super().handle_exit(sig, frame)  # a second signal, or nothing to drain
            return
        self.drain_requested = True
        manager.start_drain()  # from now on /health and new requests are 503
        loop.call_soon_threadsafe(self._begin, sig)  # safe from a signal handler

    def _begin(self, sig: int) -> None:
        self.draining = asyncio.get_running_loop().create_task(self.drain(sig))

    async def drain(self, sig: int) -> None:
        """Wait for the requests in flight, shed what is left, then shut uvicorn down."""
        manager = self.app.state.manager
        try:
            await manager.wait_idle(self.drain_s)
            logger.info("drained: no request in flight")
        except TimeoutError:
            logger.warning("drain: %d requests still in flight after %.0fs; handing them over",
                           manager.num_waited_on(), self.drain_s)  # fmt: skip
        finally:
            await manager.shed()
            super().handle_exit(sig, None)
