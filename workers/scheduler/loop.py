"""The scheduler loop: the thin async shell between Redis and the core + model runner.

Reads GenerateJob entries from the request stream (only as many as there is room for) and
every `reclaim_every_s` takes over those of dead schedulers; owns each through
shared.ownership (a new owner epoch) and resumes it from its id log. Listens for
AbortRequests on the control channel, and hands the fleet's pause, cache flush and weight
updates to workers.scheduler.steering. After every model step it sends ONE Redis transaction:
the fenced step script (a TokenBatch per token shard touched, the id log appends, finished
requests' state and acks), the abort check of every live request and, when due, the heartbeat
and the renewal of its pending entries. On stop() it drains: no new jobs, running requests
finish for up to `drain_s`, the rest is handed over at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import (
    fleet_control,
    heartbeat,
    ownership,
    protocol,
    pubsub,
    request_state,
    request_stream,
)
from shared.config import Settings
from shared.keys import HEARTBEAT_EVERY_S, Keys
from shared.redis_conn import CLUSTER_TRANSIENT, atomic
from workers.scheduler.core.scheduler import Scheduler
from workers.scheduler.core.sequence import Sequence, SequenceStatus
from workers.scheduler.grammar.compiler import GrammarCompiler
from workers.scheduler.intake import Disposition, take
from workers.scheduler.metrics import SchedulerMetrics
from workers.scheduler.steering import Steering
from workers.scheduler.step_writes import current_batches, step_writes

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0
COMPILE_POLL_S = 0.002  # nothing to do but wait for a grammar to compile
NO_GRAMMARS = protocol.FinishReason(
    type="abort", message="This scheduler cannot constrain output.", status_code=400
)

# Redis replies that mean "not now" (full, loading, restarted without our group), not a bug.
_TRANSIENT_REPLIES = ("OOM", "LOADING", "NOGROUP", "MISCONF", "READONLY", "MASTERDOWN")

Job = request_stream.Job


class ModelRunner(Protocol):
    def run(self, seqs: list[Sequence]) -> list[int]:
        """Computes each sequence's `num_new_tokens` (its KV cache slots are assigned) and
        returns the next token id of each one with `will_sample`, in order."""
        ...


def is_transient(error: Exception) -> bool:
    """Whether `error` is Redis (or a cluster's node) being away or unable to serve for a while."""
    if isinstance(error, (RedisConnectionError, RedisTimeoutError, *CLUSTER_TRANSIENT)):
        return True
    return isinstance(error, ResponseError) and any(r in str(error) for r in _TRANSIENT_REPLIES)


class SchedulerLoop:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        core: Scheduler,
        runner: ModelRunner,
        model_path: str = "",
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.redis, self.keys, self.settings = redis, keys, settings
        self.core, self.runner, self.grammars = core, runner, grammars
        self.worker_id = settings.scheduler.worker_id
        self.steering = Steering(core, runner, settings, model_path or settings.model)
        self.control, self.updater = self.steering.control, self.steering.updater
        self.last_progress = time.monotonic()  # each iteration (the watchdog reads it)
        self.metrics = SchedulerMetrics(self.worker_id)
        self._pubsub: aioredis.client.PubSub | None = None
        self._abort_rids: set[str] = set()  # applied at the start of the next step
        self._inbox: list[Job] = []  # read or reclaimed, not owned yet
        # Sequences whose new ids or finish are not in Redis yet. They stay here until a step's
        # transaction succeeds, so a failed one is simply sent again by the next.
        self._outbox: dict[str, Sequence] = {}
        self._to_ack: list[bytes] = []  # undecodable entries, and jobs someone else finished
        self._batch_changed = True
        self._last_heartbeat = 0.0
        self._last_reclaim = float("-inf")
        self._reclaim_cursors: request_stream.Cursors = {}
        self._stopping = False
        self._drain_until: float | None = None

    # -- running ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Drain and return (safe from a signal handler): see the module docstring."""
        self._stopping = True

    async def run(self, burst: bool = False) -> None:
        """Serve until stop() has drained; with `burst`, until nothing is queued or running.
        Rides out Redis outages (and a full Redis) with backoff, however long they last."""
        failing_since: float | None = None
        try:
            while not self._drained_for_stop():
                try:
                    did_work = await self.run_once()
                except (RedisError, RedisClusterException) as e:
                    if not is_transient(e):
                        raise
                    now = time.monotonic()
                    failing_since = failing_since or now
                    logger.warning("redis unavailable (%s); retrying", e)
                    await self._drop_pubsub()
                    await asyncio.sleep(min(MAX_BACKOFF_S, 0.1 + (now - failing_since) / 4))
                    continue
                failing_since = None
                if burst and not did_work and self.is_drained and not self.updater.update:
                    return
            await self._hand_over()
        finally:
            self.updater.cancel()
            await self._drop_pubsub()

    def _drained_for_stop(self) -> bool:
        if not self._stopping:
            return False
        now = time.monotonic()
        if self._drain_until is None:
            self._drain_until = now + self.settings.scheduler.drain_s
            logger.info("stopping: draining %d requests", len(self.core.unfinished))
        return self.is_drained or now >= self._drain_until

    async def _hand_over(self) -> None:
        """Make what is left claimable by another scheduler now, and stop beating."""
        rest = self._owned_entry_ids()
        idle_ms = int(self.settings.scheduler.reclaim_min_idle_s * 1000) + 1000
        try:
            await ownership.hand_over(self.redis, self.keys, self.worker_id, rest, idle_ms)
            async with self.redis.pipeline(transaction=False) as pipe:
                heartbeat.forget(pipe, self.keys, self.worker_id, heartbeat.SCHEDULER)
                await pipe.execute()
        except RedisError as e:  # they are reclaimed once idle anyway
            logger.warning("could not hand over %d jobs: %s", len(rest), e)
            return
        if rest:
            logger.info("handed over %d unfinished jobs", len(rest))

    async def aclose(self) -> None:
        await self._drop_pubsub()

    @property
    def is_drained(self) -> bool:
        return self.core.is_idle and not (self._outbox or self._inbox or self._to_ack)

    async def run_once(self) -> bool:
        """One iteration: aborts, new jobs, one model step, one Redis transaction.
        Returns whether it did anything."""
        self.last_progress = started = time.monotonic()
        if self._pubsub is None:
            await self._start()
        self._abort_rids |= await self._drain_control()
        self._apply_aborts()
        self._expire()
        steer = self.steering
        if steer.apply(self._stopping, self._outbox):
            self._batch_changed = True
        num_taken = await self._take_jobs() if steer.may_take_jobs else 0
        step_from = time.monotonic()
        seqs = self._step() if steer.may_step else []
        step_to = time.monotonic()
        published = await self._flush()
        if seqs:  # Redis' share of a stepping iteration: all of it but the step
            now = time.monotonic()
            self.metrics.observe_iteration(now - started, now - started - (step_to - step_from))
        switched = steer.advance(flushed=not self._outbox)
        self._batch_changed |= switched
        did_work = bool(num_taken or seqs or published or switched)
        if not did_work and not steer.may_step:
            await steer.idle(self.settings.scheduler.idle_block_ms / 1000)
        elif not did_work and self.core.num_compiling:
            await asyncio.sleep(COMPILE_POLL_S)
        return did_work

    def _step(self) -> list[Sequence]:
        """One model step over what the core schedules; returns the scheduled sequences."""
        seqs = self.core.schedule()
        if seqs:
            now = time.time()
            for seq in seqs:
                if seq.queue_time is None and seq.created_at:
                    seq.queue_time = max(0.0, now - seq.created_at)
            samplers = [seq for seq in seqs if seq.will_sample]  # a partial chunk has no news
            started = time.perf_counter()
            token_ids = self.runner.run(seqs)
            self.metrics.observe_step(time.perf_counter() - started, len(seqs), len(samplers))
            if self.core.postprocess(seqs, token_ids):
                self._batch_changed = True
            self._outbox.update((seq.rid, seq) for seq in samplers)
            bm = self.core.block_manager
            self.metrics.log_progress(len(self.core.running), len(self.core.waiting),
                                      bm.num_free_blocks, bm.num_total_blocks)  # fmt: skip
        return seqs


    async def _start(self) -> None:
        await request_stream.check_layout(self.redis, self.keys)
        await request_stream.ensure_group(self.redis, self.keys)
        sub = pubsub.subscriber(self.redis)
        await sub.subscribe(self.keys.control_channel)
        self._pubsub = sub
        # Subscribed first: a change after this read is heard as a broadcast.
        async with self.redis.pipeline(transaction=False) as pipe:
            fleet_control.read(pipe, self.keys)
            self.control.sync(fleet_control.decode(*await pipe.execute()))
        logger.info("worker %s serving %s", self.worker_id, self.keys.request_stream)

    async def _drop_pubsub(self) -> None:
        sub, self._pubsub = self._pubsub, None
        if sub is not None:
            try:
                await sub.aclose()
            except RedisError:
                pass

    # -- aborts ----------------------------------------------------------------------------
    async def _drain_control(self) -> set[str]:
        assert self._pubsub is not None
        return await self.control.drain(self._pubsub)

    def _apply_aborts(self) -> None:
        if not self._abort_rids:
            return
        for seq in self.core.abort(self._abort_rids):
            logger.info("rid=%s aborted after %d tokens", seq.rid, seq.num_completion_tokens)
            self._outbox[seq.rid] = seq
            self._batch_changed = True
        self._abort_rids.clear()

    def _expire(self) -> None:
        """End the requests past their deadline (also while paused), and those whose
        grammar did not compile."""
        for seq in self.core.expire() + self.core.fail_grammars():
            self._outbox[seq.rid] = seq
            self._batch_changed = True

    # -- new jobs --------------------------------------------------------------------------
    async def _take_jobs(self) -> int:
        """Take at most as many jobs as the core has room for: those of dead schedulers
        first (every reclaim_every_s), then new ones; block only when idle. None once
        stopping."""
        free = self.core.num_free_slots() - len(self._inbox)
        num_taken = 0
        if free > 0 and not self._stopping:
            jobs = await self._reclaim(free)
            free -= len(jobs)
            if free > 0:
                idle = self.is_drained and not jobs
                block_ms = self.settings.scheduler.idle_block_ms if idle else None
                jobs += await request_stream.read(
                    self.redis, self.keys, self.worker_id, free, block_ms
                )
            self._inbox += jobs
            num_taken = len(jobs)
        if self._inbox:
            await self._admit()
        return num_taken

    async def _reclaim(self, count: int) -> list[Job]:
        now = time.monotonic()
        sched = self.settings.scheduler
        if now - self._last_reclaim < sched.reclaim_every_s:
            return []
        self._last_reclaim = now
        min_idle_ms = int(sched.reclaim_min_idle_s * 1000)
        jobs = await request_stream.reclaim(
            self.redis, self.keys, self.worker_id, min_idle_ms, count, self._reclaim_cursors
        )
        if jobs:
            logger.info("reclaimed %d jobs of dead schedulers", len(jobs))
        return jobs

    async def _admit(self) -> None:
        """Own each job in the inbox (a new epoch) and act on what that found."""
        jobs = [(entry_id, job) for entry_id, job in self._inbox if job is not None]
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, job in jobs:
            ownership.own(pipe, self.keys, self.worker_id, entry_id, job.rid)
        replies = await pipe.execute() if jobs else []
        self._to_ack += [entry_id for entry_id, job in self._inbox if job is None]
        self._inbox = []
        dead = self.redis.pipeline(transaction=False)
        max_deliveries = self.settings.scheduler.max_deliveries
        for (entry_id, job), reply in zip(jobs, replies, strict=True):
            intake = take(job, entry_id, ownership.owned(reply), max_deliveries)
            if intake.disposition is Disposition.ACK:
                self._to_ack.append(entry_id)
            if intake.seq is None:
                continue
            seq = intake.seq
            if intake.disposition is Disposition.DEAD:
                logger.error("rid=%s dead-lettered: %s", seq.rid, intake.reason)
                request_stream.dead_letter(dead, self.keys, job, intake.reason, intake.deliveries)
            if intake.disposition is Disposition.RUN and self._add(seq):
                continue
            self._outbox[seq.rid] = seq
        if len(dead):
            await dead.execute()  # before the step that acks them

    def _add(self, seq: Sequence) -> bool:
        """Hand `seq` to the core; False when it ended at once (bad request, nothing to do)."""
        grammar = seq.sampling.grammar
        if grammar is not None and self.grammars is None:
            seq.status, seq.finish = SequenceStatus.FINISHED, NO_GRAMMARS
            return False
        if grammar is not None and self.grammars is not None:
            seq.grammar = self.grammars.constraint(grammar, seq.output_ids)
        reason = self.core.add(seq)
        if reason is None:
            logger.debug("rid=%s admitted at epoch %d, resumed at %d tokens",
                         seq.rid, seq.epoch, seq.num_resumed)  # fmt: skip
            self._batch_changed = True
            return True
        if reason.type == "abort":
            logger.warning("rid=%s rejected: %s", seq.rid, reason.message)
        return False

    def _owned_entry_ids(self) -> list[bytes]:
        seqs = [*self.core.unfinished, *self._outbox.values()]
        return list(dict.fromkeys([seq.entry_id for seq in seqs] + [e for e, _ in self._inbox]))

    # -- output ----------------------------------------------------------------------------
    async def _flush(self) -> bool:
        """The step's one transaction. Returns whether it sent any request's progress."""
        now = time.monotonic()
        heartbeat_due = self._batch_changed or now - self._last_heartbeat >= HEARTBEAT_EVERY_S
        live_rids = [seq.rid for seq in self.core.unfinished]
        sends = bool(self._outbox or self._to_ack)
        if not (sends or live_rids or heartbeat_due):
            return False
        outbox = list(self._outbox.values())
        version = self.control.loaded.weight_version
        steps, batches = step_writes(
            outbox, self.worker_id, self.keys, self.settings.num_token_shards, version
        )
        pipe = atomic(self.redis)
        for entry_id in self._to_ack:
            request_stream.ack(pipe, self.keys, entry_id)
        step_at = len(pipe)
        plan = ownership.publish_step(pipe, self.keys, steps, batches) if steps else None
        renew_at = control_at = -1
        renewed: list[list[bytes]] = []
        if heartbeat_due:
            beat = self.steering.beat(self._stopping, self.metrics.gen_throughput())
            heartbeat.beat(pipe, self.keys, self.worker_id, beat)
            renew_at = len(pipe)
            renewed = ownership.renew(pipe, self.keys, self.worker_id, self._owned_entry_ids())
            control_at = self.steering.queue(pipe, self.keys, self.worker_id)
        first_query = len(pipe)
        request_state.query_aborted(pipe, self.keys, live_rids)
        results = await pipe.execute()
        stale, unsent = (
            ownership.step_result(plan, results[step_at : step_at + len(plan.groups)])
            if plan else (set(), [])
        )
        lost = ownership.lost_entries(renewed, results[renew_at : renew_at + len(renewed)])
        await self._publish(current_batches(self.worker_id, steps, batches, unsent, stale))
        self._committed(outbox, stale, lost)
        if heartbeat_due:
            self._last_heartbeat, self._batch_changed = now, False
            self.steering.took(results[control_at:first_query])
        hits = results[first_query:]
        self._abort_rids.update(rid for rid, hit in zip(live_rids, hits, strict=True) if hit)
        return sends

    async def _publish(self, batches: list[tuple[str, bytes]]) -> None:
        if batches:
            pipe = self.redis.pipeline(transaction=False)
            for channel, payload in batches:
                pubsub.publish(pipe, channel, payload)
            await pipe.execute()

    def _committed(self, sent: list[Sequence], stale: set[int], lost: set[bytes]) -> None:
        """After a step's transaction: advance what was published; drop the requests that
        another scheduler owns now (stale epoch, or their entry taken over)."""
        gone = {sent[i].rid for i in stale}
        gone |= {seq.rid for seq in self.core.unfinished if seq.entry_id in lost}
        for i, seq in enumerate(sent):
            if i in stale:
                continue
            seq.num_published = seq.num_completion_tokens
            if seq.is_finished:
                assert seq.finish is not None
                logger.info("rid=%s finished (%s) after %d tokens",
                            seq.rid, seq.finish.type, seq.num_completion_tokens)  # fmt: skip
        if gone:
            logger.warning("lost ownership of %d requests (rid=%s): dropped", len(gone),
                           next(iter(gone)))  # fmt: skip
            self.core.abort(gone)
        self._outbox.clear()
        self._to_ack.clear()
