"""What the fleet's control plane asks of one scheduler, as it last heard: pause, a prefix
cache flush, the target weights. Pure (no Redis, no torch): the loop feeds it broadcasts
(`on_message`, or `drain` of its subscription) and the state it reads with its heartbeats
(`sync`), then asks it what to do.

Weights: the scheduler serves `loaded`; when the fleet's target (or, with none, the
weights it started with) differs and has not failed here before, it must update: with
mode `all` at once, with `rolling` only while it holds the fleet's one turn.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from shared import protocol
from shared.fleet_control import ControlState, Weights, target_of

logger = logging.getLogger(__name__)


class FleetControl:
    def __init__(self, started: Weights) -> None:
        self.started = started  # what this scheduler loaded at start
        self.loaded = started
        self.pause_mode: protocol.PauseMode | None = None
        self.target: Weights | None = None
        self.flush_requested = False
        self.failed: set[str] = set()  # versions that failed to load here: not tried again

    # -- inputs ----------------------------------------------------------------------------
    def on_message(self, msg: protocol.ControlMessage) -> None:
        if isinstance(msg, protocol.PauseGeneration):
            self.pause_mode = msg.mode
        elif isinstance(msg, protocol.ContinueGeneration):
            self.pause_mode = None
        elif isinstance(msg, protocol.FlushCache):
            self.flush_requested = True
        elif isinstance(msg, protocol.UpdateWeights):
            self.target = target_of(msg)

    def sync(self, state: ControlState) -> None:
        """The state in Redis wins over what the broadcasts said (one may have been missed)."""
        self.pause_mode = state.pause_mode
        self.target = state.target

    def loaded_new(self, weights: Weights) -> None:
        self.loaded = weights

    def load_failed(self, weights: Weights) -> None:
        self.failed.add(weights.weight_version)

    # -- decisions -------------------------------------------------------------------------
    @property
    def wanted(self) -> Weights:
        """The weights the fleet wants served."""
        return self.target or self.started

    def pending_update(self) -> Weights | None:
        """The weights to switch to, or None when serving the wanted ones already."""
        wanted = self.wanted
        same = (wanted.model_path, wanted.weight_version) == (
            self.loaded.model_path,
            self.loaded.weight_version,
        )
        if same or wanted.weight_version in self.failed:
            return None
        return wanted

    def take_flush(self) -> bool:
        flush, self.flush_requested = self.flush_requested, False
        return flush

    async def drain(self, pubsub: Any) -> set[str]:
        """Take every control message waiting on `pubsub` (redis PubSub): aborts are
        returned (the loop applies them), the rest change this state."""
        rids: set[str] = set()
        # (Not ignore_subscribe_messages: it turns a subscribe reply into None, ending the drain.)
        while msg := await pubsub.get_message(timeout=0):
            if msg["type"] != "message":
                continue
            try:
                ctl = protocol.decode(msg["data"], protocol.ControlMessage)
            except (msgspec.DecodeError, protocol.ProtocolVersionError) as e:
                logger.warning("ignoring undecodable control message: %s", e)
                continue
            if isinstance(ctl, protocol.AbortRequests):
                rids.update(ctl.rids)
            else:
                self.on_message(ctl)
        return rids
