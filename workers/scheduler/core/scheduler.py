"""The scheduler core: which sequences run in the next model step, and when each one ends.

Pure Python (no torch, no redis), driven by plain calls from the loop:
`add` → `schedule` → (model runner) → `postprocess`, with `abort` between steps.
Continuous batching: new sequences join and finished ones leave between any two steps.

One step mixes prefill and decode under one token budget (`max_num_batched_tokens`, as in
vLLM v1): running sequences first, each with its next token or the next chunk of its prompt,
then waiting sequences while budget, `max_num_seqs` and KV blocks last. Both queues are in
priority order (SGLang's `priority`: higher first), then arrival order.
A long prompt is thus prefilled in chunks between decode steps, and a running stream waits
at most one step of at most `max_num_batched_tokens` tokens for its next token. A sequence
samples only in the step that reaches its last token. A new sequence skips the part of its
prompt found in the prefix cache (block_manager.py). When the blocks run out, the last
running sequences (the lowest priority, the newest among equals) are preempted: they give
their blocks back (which stay cached) and are recomputed from their tokens later, and no
waiting sequence starts in that step. A sequence past its deadline ends with a 504 abort:
when it is added (a job that waited too long in the stream) or at the next `expire`.
A constrained sequence (structured output) waits until its grammar compiled, letting the
ones behind it start; its grammar takes each sampled token and ends it once it terminated.
Background sequences (priority < 0: the low band, where batch lines go) sit out every step in
which a foreground sequence prefills (`background_yields`), so an interactive request's first
token comes as fast as on an idle server; in every other step they run beside the others.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared import deadlines
from shared.protocol import FinishReason
from workers.scheduler.core.block_manager import BlockManager
from workers.scheduler.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

DecodeTail = Callable[[list[int]], str]

ABORTED = FinishReason(type="abort", message="Abort requested.")
EMBEDDED = FinishReason(type="length", length=0)


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one sequence
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # tokens computed in one step (the chunk size too)
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    background_yields: bool = True


def _bad_request(message: str) -> FinishReason:
    return FinishReason(type="abort", message=message, status_code=400)


def _order(seq: Sequence) -> tuple[int, int]:
    """Where a sequence goes in a queue: higher priority first, then earlier arrival."""
    return -seq.priority, seq.arrival


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        decode_tail: DecodeTail,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`decode_tail(ids)` turns a few output ids into text for the stop-string check;
        `clock()` is the unix time that deadlines are compared with."""
        self.config = config
        self.decode_tail = decode_tail
        self.clock = clock
        self._arrivals = itertools.count(1)
        assert config.max_num_batched_tokens > 0
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        # One sequence can never outgrow the whole cache.
        self.max_model_len = min(config.max_model_len, config.num_kv_blocks * config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    # -- admission -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> FinishReason | None:
        """Queue `seq`, or return why it ends right away (a bad request, or nothing to do)."""
        reason = self._check(seq) or self._late(seq)
        if reason is not None:
            seq.status, seq.finish = SequenceStatus.FINISHED, reason
            return reason
        seq.arrival = next(self._arrivals)
        _enqueue(self.waiting, seq)
        return None

    def _late(self, seq: Sequence) -> FinishReason | None:
        if deadlines.is_past(seq.deadline, self.clock()):
            return deadlines.exceeded(seq.deadline - seq.created_at)
        return None

    def _check(self, seq: Sequence) -> FinishReason | None:
        n = seq.num_prompt_tokens
        if n == 0:
            return _bad_request("The input is empty.")
        if n > self.max_model_len or (n == self.max_model_len and not seq.embed):
            return _bad_request(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.max_model_len} tokens)."
            )
        sp, lp = seq.sampling, seq.logprobs
        # Ids the sampler indexes with too: an out-of-vocabulary one would fail the batch.
        other_ids = [*sp.stop_token_ids, *sp.logit_bias, *(lp.request.token_ids if lp else [])]
        bad_ids = [t for t in seq.token_ids + other_ids if not 0 <= t < self.config.vocab_size]
        if bad_ids:
            return _bad_request(
                f"Token id {bad_ids[0]} is out of vocabulary (vocab size {self.config.vocab_size})."
            )
        if seq.sampling.max_new_tokens < 0:
            return _bad_request("max_new_tokens must be at least 0.")
        done = seq.num_completion_tokens  # > 0 for a request resumed after its owner died
        if done >= seq.sampling.max_new_tokens and not seq.prefill_only:
            return FinishReason(type="length", length=seq.sampling.max_new_tokens)
        if done and len(seq) >= self.max_model_len:
            return FinishReason(type="length", length=done)
        return None

    def num_free_slots(self) -> int:
        """How many more sequences to take in now: bounded by max_num_seqs and by the free
        KV blocks not already promised to waiting sequences (each new one needs one or more)."""
        bm = self.block_manager
        seq_room = self.config.max_num_seqs - len(self.waiting) - len(self.running)
        promised = sum(bm.num_blocks_for(len(seq)) for seq in self.waiting)
        return max(0, min(seq_room, bm.num_free_blocks - promised))

    @property
    def unfinished(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    # -- stepping --------------------------------------------------------------------------
    def schedule(self) -> list[Sequence]:
        """The sequences of the next model step, each with its `num_new_tokens` set:
        foreground first (running, then starting), then background unless it yields."""
        scheduled: list[Sequence] = []
        for background in (False, True):
            if background and self.config.background_yields and _prefills(scheduled):
                break
            budget = self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
            num_running = len(self.running)
            part = [s for s in self.running if _is_background(s) == background]
            scheduled += self._schedule_running(budget, part)
            budget = self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
            if len(self.running) != num_running:  # a preemption: no newcomers this step
                break
            scheduled += self._schedule_waiting(budget, background)
        return scheduled

    def _schedule_running(self, budget: int, candidates: list[Sequence]) -> list[Sequence]:
        """A decode token or the next prompt chunk of each candidate (running, in order)
        while the budget lasts; preempts the last running ones when the blocks run out."""
        scheduled: list[Sequence] = []
        for seq in candidates:
            if budget <= 0 or seq.status != SequenceStatus.RUNNING:  # preempted just now
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + num_new):
                break
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            seq.num_new_tokens = num_new
            budget -= num_new
            scheduled.append(seq)
        return scheduled

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the last running sequences (the lowest priority, newest among equals)
        until `seq` can hold `num_tokens` tokens; False if `seq` itself had to go."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, budget: int, background: bool) -> list[Sequence]:
        """Start waiting sequences (foreground or background ones) in order (their cached
        prefix, then a first chunk) while the budget, max_num_seqs and the free blocks allow."""
        bm = self.block_manager
        scheduled: list[Sequence] = []
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if _is_background(seq) != background:
                continue
            if not seq.is_ready:  # its grammar is still compiling: the next ones may start
                continue
            bm.allocate_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq, seq.num_computed_tokens + num_new):
                bm.deallocate(seq)
                break
            bm.allocate(seq, seq.num_computed_tokens + num_new)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.num_new_tokens = num_new
            budget -= num_new
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            _enqueue(self.running, seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence, why: str = "preempted (KV cache full)") -> None:
        logger.info("rid=%s %s at %d tokens", seq.rid, why, len(seq))
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.block_manager.deallocate(seq)
        _enqueue(self.waiting, seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Mark each sequence's new tokens computed (caching its newly full blocks), then
        append the sampled token of each that reached its end — `token_ids` has one per
        `seq.will_sample`, in order; finish, free and return those that are done."""
        samplers = [seq for seq in seqs if seq.will_sample]
        for seq in seqs:
            computed_before = seq.num_computed_tokens
            seq.num_computed_tokens += seq.num_new_tokens
            seq.num_new_tokens = 0
            self.block_manager.cache_blocks(seq, computed_before)
        finished = []
        for seq, token_id in zip(samplers, token_ids, strict=True):
            if seq.prefill_only:  # the runner set seq.embedding or the prompt logprobs
                self._finish(seq, EMBEDDED)
                finished.append(seq)
                continue
            seq.append_token(token_id)
            reason = self._grammar_finish(seq, token_id) or self._finish_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        # SGLang's order: the length budget first, then stop tokens, then stop strings.
        sp = seq.sampling
        if seq.num_completion_tokens >= sp.max_new_tokens:
            return FinishReason(type="length", length=sp.max_new_tokens)
        if token_id in sp.stop_token_ids or (
            not sp.ignore_eos and token_id in self.config.eos_token_ids
        ):
            return FinishReason(type="stop", matched=token_id)
        # Before min_new_tokens no stop string ends it either (SGLang; the sampler masks eos
        # and stop_token_ids until then).
        if sp.stop and seq.num_completion_tokens >= sp.min_new_tokens:
            matched = self._matched_stop(seq)
            if matched is not None:
                return FinishReason(type="stop", matched=matched)
        if len(seq) >= self.max_model_len:
            return FinishReason(type="length", length=seq.num_completion_tokens)
        return None

    def _grammar_finish(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Feed the token to the request's grammar: a grammar that ended (it took eos, or
        allows nothing more) ends the request with `stop`."""
        grammar = seq.grammar
        if grammar is None:
            return None
        if not grammar.accept(token_id):  # the sampler's mask forbids this: a bug
            return FinishReason(
                type="abort", message=f"Token {token_id} broke the grammar.", status_code=500
            )
        if grammar.is_terminated():
            return FinishReason(type="stop", matched=token_id)
        return None

    def _matched_stop(self, seq: Sequence) -> str | None:
        # A stop string of n characters spans at most n tokens; one more covers a token that
        # only partly belongs to it. Any match must involve the newest token (else it had
        # matched a step earlier), so a short tail suffices.
        window = max(len(s) for s in seq.sampling.stop) + 1
        tail = self.decode_tail(seq.output_ids[-window:])
        return next((s for s in seq.sampling.stop if s and s in tail), None)

    # -- leaving ---------------------------------------------------------------------------
    def abort(self, rids: Iterable[str], reason: FinishReason = ABORTED) -> list[Sequence]:
        """Drop the sequences of `rids` that are here and free their blocks now."""
        wanted = set(rids)
        aborted = [seq for seq in self.unfinished if seq.rid in wanted]
        for seq in aborted:
            self._drop(seq, reason)
        return aborted

    def expire(self) -> list[Sequence]:
        """End the sequences (waiting or running) past their deadline and free their blocks
        now; their finish (a 504 abort) is for the caller to publish."""
        now = self.clock()
        late = [seq for seq in self.unfinished if deadlines.is_past(seq.deadline, now)]
        for seq in late:
            logger.info("rid=%s past its deadline after %d tokens", seq.rid,
                        seq.num_completion_tokens)  # fmt: skip
            self._drop(seq, deadlines.exceeded(seq.deadline - seq.created_at))
        return late

    def fail_grammars(self) -> list[Sequence]:
        """End the waiting sequences whose grammar cannot constrain them (it did not
        compile): a 400 abort, for the caller to publish."""
        failed = [
            seq for seq in self.waiting
            if seq.grammar is not None and seq.grammar.ready and seq.grammar.failure
        ]  # fmt: skip
        for seq in failed:
            assert seq.grammar is not None and seq.grammar.failure is not None
            self._drop(seq, _bad_request(seq.grammar.failure))
        return failed

    @property
    def num_compiling(self) -> int:
        """Waiting sequences held back until their grammar compiled."""
        return sum(seq.grammar is not None and not seq.grammar.ready for seq in self.waiting)

    def _drop(self, seq: Sequence, reason: FinishReason) -> None:
        queue = self.waiting if seq.status == SequenceStatus.WAITING else self.running
        queue.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status, seq.finish = SequenceStatus.FINISHED, reason

    def retract_all(self) -> int:
        """Return every running sequence to the front of the waiting queue, its blocks freed
        (cached blocks stay reusable): it is recomputed from its tokens when it runs again.
        Returns how many were running."""
        retracted = list(self.running)
        for seq in reversed(retracted):
            self.running.remove(seq)
            self._preempt(seq, "retracted")
        return len(retracted)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish = SequenceStatus.FINISHED, reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)


def _is_background(seq: Sequence) -> bool:
    return seq.priority < 0


def _prefills(seqs: list[Sequence]) -> bool:
    """Whether any of a step's sequences computes prompt positions (or recomputes more than
    a decode's one token after a preemption)."""
    return any(
        seq.num_new_tokens > 1 or seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs
    )


def _enqueue(queue: deque[Sequence], seq: Sequence) -> None:
    """Put `seq` behind every sequence of `queue` that goes before it (_order)."""
    queue.insert(bisect.bisect_right(queue, _order(seq), key=_order), seq)
