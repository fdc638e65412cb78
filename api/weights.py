"""Live weight updates, the api's side (SGLang's update_weights_from_disk over the fleet).

An update (`WeightUpdates.update`, POST /update_weights_from_disk on any replica) sets the
fleet's target weights (`rs:weights` + an UpdateWeights broadcast on `rs:ctl`, written by
shared.fleet_control), then waits until every scheduler that was live when it began (and
still is) has loaded them: a result in `weights_results(version)`, or a beat that serves
that version. All "ok": success. Otherwise (a failure, a timeout, every scheduler gone) the
previous target is set again, so the schedulers that switched go back, and the answer names
each failing scheduler and why.

Mode `all`: while an update is in progress, new requests wait on EVERY replica. Each
replica's `ReadWriteGate` (the seed's model_update_lock) is held on its reader side by each
request while it is tokenized and submitted; the updating replica takes the writer side
(waiting for those inside), and every replica that hears an UpdateWeights(mode="all")
closes its gate until that update is over (`hold`: the same check as the update's wait, or
the target changed, or the timeout). Mode `rolling`: no gate; the schedulers take turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from api.errors import ServiceUnavailable
from api.host import Core
from api.model import ModelInfo
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.schemas.weights import UpdateWeightsIn
from shared import fleet_control, heartbeat, protocol
from shared.fleet_control import STARTED_VERSION, Weights

logger = logging.getLogger(__name__)

T = TypeVar("T")
POLL_S = 0.2  # how often an update (or a hold) looks at the schedulers' progress
OK = "ok"


class ReadWriteGate:
    """Many readers at once; while any writer holds it (or waits for the readers inside to
    leave), new readers wait. Writers do not exclude each other: they only close the gate."""

    def __init__(self) -> None:
        self.readers = 0
        self.writers = 0
        self.waiting = 0  # readers held at the gate
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            await self._wait_until(lambda: self.writers == 0)
        finally:
            self.waiting -= 1
        self.readers += 1
        try:
            yield
        finally:
            self.readers -= 1
            self._notify()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Close the gate, wait for the readers inside, hold it until the block ends."""
        self.close()
        try:
            await self._wait_until(lambda: self.readers == 0)
            yield
        finally:
            self.open()

    def close(self) -> None:
        self.writers += 1

    def open(self) -> None:
        self.writers -= 1
        self._notify()


@dataclass
class Progress:
    """Where the schedulers of an update stand."""

    results: dict[str, str] = field(default_factory=dict)  # worker -> "ok" | why it failed
    pending: list[str] = field(default_factory=list)  # live, not done yet

    @property
    def failures(self) -> dict[str, str]:
        return {w: r for w, r in self.results.items() if r != OK}


@dataclass(frozen=True)
class UpdateResult:
    success: bool
    message: str
    weight_version: str

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message,
                "weight_version": self.weight_version}  # fmt: skip


def new_weight_version() -> str:
    """A fresh, unique version: when (UTC) and a random tail."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


class Host(Core, Protocol):
    """What the updates use of the TokenizerManager."""

    model: ModelInfo
    draining: bool

    async def abort_all(self) -> None:
        """Abort every request of this replica."""


class WeightUpdates:
    def __init__(self, tm: Host) -> None:
        self.tm = tm
        self.gate = ReadWriteGate()
        self._one_at_a_time = asyncio.Lock()
        self.timeout_s = tm.settings.api.update_weights_timeout_s

    # -- requests and the gate --------------------------------------------------------------
    def reading(self) -> AbstractAsyncContextManager[None]:
        """Held by a request while it is tokenized and submitted."""
        return self.gate.reading()

    async def current(self) -> tuple[str, str]:
        """(model_path, weight_version) of the fleet's target, else of the started model."""
        try:
            target = await self._redis(fleet_control.get_target(self.tm.redis, self.tm.keys))
        except REDIS_ERRORS as e:
            raise unavailable(e, "Redis is unavailable.") from e
        if target is None:
            return self.tm.model.model_path, STARTED_VERSION
        return target.model_path, target.weight_version

    # -- the update -------------------------------------------------------------------------
    async def update(self, body: UpdateWeightsIn) -> UpdateResult:
        if self.tm.draining:
            raise ServiceUnavailable("The server is shutting down.")
        target = Weights(body.model_path, body.weight_version or new_weight_version(), body.mode)
        try:
            async with self._one_at_a_time:
                if body.abort_all_requests:
                    await self.tm.abort_all()
                async with self.gate.writing() if body.mode == "all" else nullcontext():
                    result = await self._update(target)
        except REDIS_ERRORS as e:
            message = "Redis is unavailable: the update's outcome is unknown (see /get_model_info)."
            raise unavailable(e, message) from e
        log = logger.info if result.success else logger.error
        log("weight update %s (%s, %s): %s", target.weight_version, target.model_path,
            target.mode, result.message)  # fmt: skip
        return result

    async def _update(self, target: Weights) -> UpdateResult:
        version = target.weight_version
        workers = await self._live_schedulers()
        if not workers:
            return UpdateResult(False, "No scheduler is serving: nothing to update.", version)
        previous = await self._redis(fleet_control.get_target(self.tm.redis, self.tm.keys))
        if (
            previous
            and previous.weight_version == version
            and previous.model_path != target.model_path
        ):
            message = f"weight_version {version} already names {previous.model_path}"
            return UpdateResult(False, message, version)
        await self._forget_loaded(version)
        await self._redis(fleet_control.set_target(self.tm.redis, self.tm.keys, target))
        progress, superseded = await self._wait(target, workers)
        if superseded is not None:
            message = f"Superseded by weight_version {superseded} before it was loaded everywhere."
            return UpdateResult(False, message, version)
        if progress.results and not progress.failures and not progress.pending:
            return UpdateResult(True, _succeeded(target, progress), version)
        await self._restore(previous, target.mode)
        return UpdateResult(False, self._failed(target, progress, previous), version)

    async def _wait(self, target: Weights, workers: list[str]) -> tuple[Progress, str | None]:
        """Poll until none of `workers` is pending or the timeout; also the version that
        superseded `target` if another update changed the fleet's target meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            progress = await self._progress(target.weight_version, workers)
            if not progress.pending or time.monotonic() >= deadline:
                return progress, None
            now = await self._redis(fleet_control.get_target(self.tm.redis, self.tm.keys))
            if now != target:
                return progress, now.weight_version if now else STARTED_VERSION
            await asyncio.sleep(POLL_S)

    async def _restore(self, previous: Weights | None, mode: str) -> None:
        """Make `previous` the target again (None: the started weights, switched to by the
        failed update's `mode`): the schedulers that switched go back."""
        await self._forget_loaded(previous.weight_version if previous else STARTED_VERSION)
        await self._redis(fleet_control.set_target(self.tm.redis, self.tm.keys, previous, mode))

    def _failed(self, target: Weights, progress: Progress, previous: Weights | None) -> str:
        back = previous.weight_version if previous else STARTED_VERSION
        reasons = [f"{w}: {why}" for w, why in sorted(progress.failures.items())]
        if progress.pending:
            reasons.append(
                f"timed out after {self.timeout_s:g}s waiting for {', '.join(progress.pending)}"
            )
        if not reasons:
            reasons.append("every scheduler stopped during the update")
        return (
            f"Failed to update model weights to {target.weight_version} ({target.model_path}): "
            f"{'; '.join(reasons)}. Rolled back to weight_version {back}."
        )

    # -- other replicas' updates ------------------------------------------------------------
    def on_broadcast(self, msg: protocol.UpdateWeights) -> None:
        """An UpdateWeights on `ctl` (any replica's, this one's too): with mode `all`, new
        requests here wait until that update is over."""
        if msg.mode != "all" or self.tm.draining:
            return
        self.gate.close()
        if not self.tm.spawn(self._hold(fleet_control.target_of(msg))):
            self.gate.open()

    async def _hold(self, target: Weights | None) -> None:
        """Keep the gate closed (it is, by `on_broadcast`) until `target`'s update is over."""
        version = target.weight_version if target else STARTED_VERSION
        try:
            deadline = time.monotonic() + self.timeout_s
            workers = await self._live_schedulers()
            while time.monotonic() < deadline and not self.tm.draining:
                progress = await self._progress(version, workers)
                now = await self._redis(fleet_control.get_target(self.tm.redis, self.tm.keys))
                if not progress.pending or now != target:
                    return
                await asyncio.sleep(POLL_S)
            logger.warning("stopped waiting for weight update %s after %.0fs", version,
                           self.timeout_s)  # fmt: skip
        except REDIS_ERRORS as e:
            logger.warning("stopped waiting for weight update %s: %r", version, e)
        finally:
            self.gate.open()

    # -- the fleet's progress -----------------------------------------------------------------
    async def _progress(self, version: str, workers: list[str]) -> Progress:
        """Each of `workers` that answered for `version` (its result, or "ok" when it beats
        that version in a serving state), and those still alive that did not yet."""
        r, keys = self.tm.redis, self.tm.keys
        got = await self._redis(fleet_control.results(r, keys, version))
        alive = set(await self._live_schedulers())
        progress = Progress()
        for worker in workers:
            if worker in got:
                progress.results[worker] = got[worker]
            elif worker in alive:
                beat = await self._redis(heartbeat.read(r, keys, worker))
                serving = beat is not None and beat.state in heartbeat.SERVING_STATES
                if serving and beat is not None and beat.weight_version == version:
                    progress.results[worker] = OK
                else:
                    progress.pending.append(worker)
        return progress

    async def _forget_loaded(self, version: str) -> None:
        """Drop the "ok" results an earlier attempt at `version` left (the schedulers load
        it again); failures stay: a scheduler does not retry a version that failed there."""
        r, key = self.tm.redis, self.tm.keys.weights_results(version)
        got = await self._redis(fleet_control.results(r, self.tm.keys, version))
        if loaded := [w for w, result in got.items() if result == OK]:
            await self._redis(r.hdel(key, *loaded))  # type: ignore[arg-type]

    async def _live_schedulers(self) -> list[str]:
        r, keys = self.tm.redis, self.tm.keys
        return await self._redis(heartbeat.live_workers(r, keys, heartbeat.SCHEDULER))

    @staticmethod
    async def _redis(call: Awaitable[T]) -> T:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            return await call


def _succeeded(target: Weights, progress: Progress) -> str:
    return (
        f"Succeeded to update model weights: {len(progress.results)} schedulers serve "
        f"weight_version {target.weight_version} ({target.model_path})."
    )
