"""Noticing that another replica took a request over (DESIGN §4.9): a Reattach on `rs:ctl`
from another replica names rids; for a stream held here, the attachment recorded in Redis is
checked (a notice can be older than a re-attach here), and if it moved, the request ends here
quietly: no abort, no release, no [DONE]. A lost notice costs nothing but time: this
replica's next log append, or its grace abort, finds out too (both compare-and-set)."""

from __future__ import annotations

import asyncio
import logging

from api.host import Core
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S
from api.req_state import ReqState
from shared import protocol, reattach

logger = logging.getLogger(__name__)


class Handover:
    def __init__(self, tm: Core) -> None:
        self.tm = tm

    def on_notice(self, msg: protocol.Reattach) -> None:
        tm = self.tm
        if msg.api_id == tm.api_id:
            return
        states = [tm.rid_to_state[r] for r in msg.rids if r in tm.rid_to_state]
        if states:
            tm.spawn(self._confirm(states))

    async def _confirm(self, states: list[ReqState]) -> None:
        tm = self.tm
        for state in states:
            if state.stream_rid is None or state.attach_id is None:
                continue  # not a stream: nothing can take it over
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    owner = await reattach.attach_id_of(tm.redis, tm.keys, state.stream_rid)
            except REDIS_ERRORS:
                continue
            if owner != state.attach_id:
                logger.info("rid=%s re-attached by %s", state.rid, owner)
                tm.supersede(state)
