"""The scheduler loop: the thin async shell between Redis and the core + model runner.

Reads GenerateJob entries from the request stream (only as many as there is room for),
listens for AbortRequests on the control channel, and after every model step sends ONE
Redis transaction: a TokenBatch per token shard touched, the id log appends, finished
requests' state and acks, the abort check of every live request, and the heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Protocol

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import heartbeat, protocol, request_state, request_stream
from shared.config import Settings
from shared.keys import HEARTBEAT_EVERY_S, Keys, shard_of
from workers.scheduler.core.scheduler import ABORTED, Scheduler
from workers.scheduler.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# A Redis that stays away this long is gone for good: exit and let the supervisor restart us.
RECONNECT_GIVE_UP_S = 60.0
MAX_BACKOFF_S = 2.0
STATS_EVERY_S = 10.0

Job = tuple[bytes, protocol.GenerateJob | None]


class ModelRunner(Protocol):
    def run(self, seqs: list[Sequence]) -> list[int]:
        """Computes each sequence's `num_new_tokens` (its KV cache slots are assigned) and
        returns the next token id of each one with `will_sample`, in order."""
        ...


class SchedulerLoop:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        core: Scheduler,
        runner: ModelRunner,
    ) -> None:
        self.redis, self.keys, self.settings = redis, keys, settings
        self.core, self.runner = core, runner
        self.worker_id = settings.scheduler.worker_id
        self._pubsub: aioredis.client.PubSub | None = None
        self._abort_rids: set[str] = set()  # applied at the start of the next step
        self._inbox: list[Job] = []  # read, not yet admitted
        # Sequences whose new ids or finish are not in Redis yet. They stay here until a step's
        # transaction succeeds, so a failed one is simply sent again by the next.
        self._outbox: dict[str, Sequence] = {}
        self._to_mark: list[Sequence] = []  # admitted, state not marked running yet
        self._to_ack: list[bytes] = []  # undecodable entries
        self._batch_changed = True
        self._last_heartbeat = 0.0
        self._stats = (time.monotonic(), 0)  # since, tokens generated
        self._stopping = False

    # -- running ---------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True

    async def run(self, burst: bool = False) -> None:
        """Serve until stop(); with `burst`, until nothing is queued or running. Rides out a
        Redis outage with backoff and raises once it lasts RECONNECT_GIVE_UP_S."""
        failing_since: float | None = None
        try:
            while not self._stopping:
                try:
                    did_work = await self.run_once()
                except (RedisConnectionError, RedisTimeoutError) as e:
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since > RECONNECT_GIVE_UP_S:
                        raise
                    logger.warning("redis unavailable (%s); retrying", e)
                    await self._drop_pubsub()
                    await asyncio.sleep(min(MAX_BACKOFF_S, 0.1 + (now - failing_since) / 4))
                    continue
                failing_since = None
                if burst and not did_work and self.is_drained:
                    return
        finally:
            await self._drop_pubsub()

    async def aclose(self) -> None:
        await self._drop_pubsub()

    @property
    def is_drained(self) -> bool:
        return self.core.is_idle and not (self._outbox or self._inbox or self._to_ack)

    async def run_once(self) -> bool:
        """One iteration: aborts, new jobs, one model step, one Redis transaction.
        Returns whether it did anything."""
        if self._pubsub is None:
            await self._start()
        self._abort_rids |= await self._drain_control()
        self._apply_aborts()
        num_read = await self._take_jobs()
        seqs = self.core.schedule()
        if seqs:
            samplers = [seq for seq in seqs if seq.will_sample]  # a partial chunk has no news
            token_ids = self.runner.run(seqs)
            if self.core.postprocess(seqs, token_ids):
                self._batch_changed = True
            self._outbox.update((seq.rid, seq) for seq in samplers)
            self._log_stats(len(samplers))
        published = await self._flush()
        return bool(num_read or seqs or published)

    async def _start(self) -> None:
        await request_stream.ensure_group(self.redis, self.keys)
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.keys.control_channel)
        self._pubsub = pubsub
        logger.info("worker %s serving %s", self.worker_id, self.keys.request_stream)

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except RedisConnectionError:
                pass

    # -- aborts ----------------------------------------------------------------------------
    async def _drain_control(self) -> set[str]:
        assert self._pubsub is not None
        rids: set[str] = set()
        # (Not ignore_subscribe_messages: it turns a subscribe reply into None, ending the drain.)
        while msg := await self._pubsub.get_message(timeout=0):
            if msg["type"] != "message":
                continue
            try:
                ctl = protocol.decode(msg["data"], protocol.ControlMessage)
            except (msgspec.DecodeError, protocol.ProtocolVersionError) as e:
                logger.warning("ignoring undecodable control message: %s", e)
                continue
            if isinstance(ctl, protocol.AbortRequests):
                rids.update(ctl.rids)
        return rids

    def _apply_aborts(self) -> None:
        if not self._abort_rids:
            return
        for seq in self.core.abort(self._abort_rids):
            logger.info("rid=%s aborted after %d tokens", seq.rid, seq.num_completion_tokens)
            self._outbox[seq.rid] = seq
            self._batch_changed = True
        self._abort_rids.clear()

    # -- new jobs --------------------------------------------------------------------------
    async def _take_jobs(self) -> int:
        """Read at most as many jobs as the core has room for; block only when idle."""
        free = self.core.num_free_slots() - len(self._inbox)
        num_read = 0
        if free > 0:
            block_ms = self.settings.scheduler.idle_block_ms if self.is_drained else None
            jobs = await request_stream.read(self.redis, self.keys, self.worker_id, free, block_ms)
            self._inbox += jobs
            num_read = len(jobs)
        if self._inbox:
            await self._admit()
        return num_read

    async def _admit(self) -> None:
        rids = [job.rid for _entry_id, job in self._inbox if job is not None]
        aborted = await self._aborted_among(rids)
        jobs, self._inbox = self._inbox, []
        for entry_id, job in jobs:
            if job is None:
                self._to_ack.append(entry_id)
                continue
            seq = Sequence(
                job.rid,
                job.input_ids,
                job.sampling,
                epoch=1,
                entry_id=entry_id,
                detok=job.detok,
                logprobs=job.logprobs,
                embed=job.embed,
            )
            if job.rid in aborted:
                seq.status, seq.finish = SequenceStatus.FINISHED, ABORTED
            elif (reason := self.core.add(seq)) is None:
                logger.debug("rid=%s admitted, %d prompt tokens", seq.rid, seq.num_prompt_tokens)
                self._to_mark.append(seq)
                self._batch_changed = True
                continue
            elif reason.type == "abort":
                logger.warning("rid=%s rejected: %s", seq.rid, reason.message)
            self._outbox[seq.rid] = seq

    async def _aborted_among(self, rids: list[str]) -> set[str]:
        if not rids:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        request_state.query_aborted(pipe, self.keys, rids)
        hits = await pipe.execute()
        return {rid for rid, hit in zip(rids, hits, strict=True) if hit}

    # -- output ----------------------------------------------------------------------------
    async def _flush(self) -> bool:
        """The step's one transaction. Returns whether it sent any request's progress."""
        now = time.monotonic()
        heartbeat_due = self._batch_changed or now - self._last_heartbeat >= HEARTBEAT_EVERY_S
        live_rids = [seq.rid for seq in self.core.unfinished]
        sends = bool(self._outbox or self._to_mark or self._to_ack)
        if not (sends or live_rids or heartbeat_due):
            return False
        pipe = self.redis.pipeline(transaction=True)
        for seq in self._to_mark:
            request_state.mark_running(pipe, self.keys, seq.rid, self.worker_id, seq.epoch)
        for entry_id in self._to_ack:
            request_stream.ack(pipe, self.keys, entry_id)
        self._queue_outputs(pipe)
        if heartbeat_due:
            self._queue_heartbeat(pipe)
        first_query = len(pipe)
        request_state.query_aborted(pipe, self.keys, live_rids)
        results = await pipe.execute()
        self._committed()
        if heartbeat_due:
            self._last_heartbeat, self._batch_changed = now, False
        hits = results[first_query:]
        self._abort_rids.update(rid for rid, hit in zip(live_rids, hits, strict=True) if hit)
        return sends

    def _queue_outputs(self, pipe: aioredis.client.Pipeline) -> None:
        """The outbox's news: a TokenBatch per shard, the id log appends, and for finished
        requests their final state and the ack."""
        batches: dict[int, list[protocol.TokenEntry]] = defaultdict(list)
        for seq in self._outbox.values():
            entry = token_entry(seq)
            batches[shard_of(seq.rid, self.settings.num_token_shards)].append(entry)
            request_state.append_ids(pipe, self.keys, seq.rid, entry.token_ids)
        for shard, entries in batches.items():
            batch = protocol.TokenBatch(worker_id=self.worker_id, entries=entries)
            pipe.publish(self.keys.token_channel(shard), protocol.encode(batch))
        # Invariant 1: finish and ack only in the transaction that carries the last output.
        for seq in self._outbox.values():
            if not seq.is_finished:
                continue
            assert seq.finish is not None
            request_state.finish(
                pipe,
                self.keys,
                seq.rid,
                seq.finish,
                seq.num_completion_tokens,
                seq.num_cached_tokens,
            )
            request_stream.ack(pipe, self.keys, seq.entry_id)

    def _queue_heartbeat(self, pipe: aioredis.client.Pipeline) -> None:
        bm = self.core.block_manager
        beat = heartbeat.SchedulerBeat(
            num_running=len(self.core.running),
            num_waiting=len(self.core.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks,
        )
        heartbeat.beat(pipe, self.keys, self.worker_id, beat)

    def _committed(self) -> None:
        for seq in self._outbox.values():
            seq.num_published = seq.num_completion_tokens
            if seq.is_finished:
                assert seq.finish is not None
                logger.info(
                    "rid=%s finished (%s) after %d tokens",
                    seq.rid,
                    seq.finish.type,
                    seq.num_completion_tokens,
                )
        self._outbox.clear()
        self._to_mark.clear()
        self._to_ack.clear()

    def _log_stats(self, num_tokens: int) -> None:
        since, count = self._stats
        count += num_tokens
        now = time.monotonic()
        if now - since < STATS_EVERY_S:
            self._stats = (since, count)
            return
        bm = self.core.block_manager
        logger.info(
            "%.1f tok/s; running=%d waiting=%d free_blocks=%d/%d",
            count / (now - since),
            len(self.core.running),
            len(self.core.waiting),
            bm.num_free_blocks,
            bm.num_total_blocks,
        )
        self._stats = (now, 0)


def token_entry(seq: Sequence) -> protocol.TokenEntry:
    """What `seq` has not published yet, as one wire entry: its new ids from `seq`
    num_published on, their logprobs, and with the first entry its detokenizer params and
    prompt logprobs; with the last, its finish and embedding."""
    new_ids = seq.unpublished_ids()
    lp, first = seq.logprobs, seq.num_published
    # Prompt logprobs ride on the first entry that carries tokens (or the finish).
    first_out = first == 0 and bool(new_ids or seq.finish)
    return protocol.TokenEntry(
        rid=seq.rid,
        epoch=seq.epoch,
        seq=first,
        token_ids=new_ids,
        prompt_tokens=seq.num_prompt_tokens,
        finish=seq.finish,
        cached_tokens=seq.num_cached_tokens,
        detok=seq.detok if first == 0 else None,
        output_logprobs=lp.output_slice(first, first + len(new_ids)) if lp else None,
        input_logprobs=lp.input if lp and first_out else None,
        embedding=seq.embedding if seq.is_finished else None,
    )
