"""The scheduler core: which sequences run in the next model step, and when each one ends.

Pure Python (no torch, no redis), driven by plain calls from the loop:
`add` → `schedule` → (model runner) → `postprocess`, with `abort` between steps.
Continuous batching: new sequences join and finished ones leave between any two steps.
A step is either a prefill (new sequences, prompt tokens) or a decode (one token for every
running sequence), as in nano-vllm. When decode runs out of KV blocks the newest running
sequence is preempted: it gives its blocks back and is recomputed from its tokens later.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.protocol import FinishReason
from workers.scheduler.block_manager import BlockManager
from workers.scheduler.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

DecodeTail = Callable[[list[int]], str]

ABORTED = FinishReason(type="abort", message="Abort requested.")


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one sequence
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


def _bad_request(message: str) -> FinishReason:
    return FinishReason(type="abort", message=message, status_code=400)


class Scheduler:
    def __init__(self, config: SchedulerConfig, decode_tail: DecodeTail) -> None:
        """`decode_tail(ids)` turns a few output ids into text for the stop-string check."""
        self.config = config
        self.decode_tail = decode_tail
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        # One sequence can never outgrow the whole cache.
        self.max_model_len = min(config.max_model_len, config.num_kv_blocks * config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    # -- admission -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> FinishReason | None:
        """Queue `seq`, or return why it ends right away (a bad request, or nothing to do)."""
        reason = self._check(seq)
        if reason is not None:
            seq.status, seq.finish = SequenceStatus.FINISHED, reason
            return reason
        self.waiting.append(seq)
        return None

    def _check(self, seq: Sequence) -> FinishReason | None:
        n = seq.num_prompt_tokens
        if n == 0:
            return _bad_request("The input is empty.")
        if n >= self.max_model_len:
            return _bad_request(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.max_model_len} tokens)."
            )
        bad_ids = [t for t in seq.token_ids if not 0 <= t < self.config.vocab_size]
        if bad_ids:
            return _bad_request(
                f"Token id {bad_ids[0]} is out of vocabulary (vocab size {self.config.vocab_size})."
            )
        if seq.sampling.max_new_tokens < 0:
            return _bad_request("max_new_tokens must be at least 0.")
        if seq.sampling.max_new_tokens == 0:
            return FinishReason(type="length", length=0)
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
    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next model step and whether it is a prefill."""
        seqs = self._schedule_prefill()
        if seqs:
            return seqs, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        bm, num_tokens = self.block_manager, 0
        scheduled: list[Sequence] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # The first sequence always fits the token budget: there is no chunked prefill yet.
            over_budget = num_tokens + len(seq) > self.config.max_num_batched_tokens
            if (scheduled and over_budget) or not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            num_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.config.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                bm.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        logger.info("rid=%s preempted (KV cache full) at %d tokens", seq.rid, len(seq))
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sequence's new token; finish, free and return those that are done."""
        finished = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.append_token(token_id)
            reason = self._finish_reason(seq, token_id)
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
        if sp.stop:
            matched = self._matched_stop(seq)
            if matched is not None:
                return FinishReason(type="stop", matched=matched)
        if len(seq) >= self.max_model_len:
            return FinishReason(type="length", length=seq.num_completion_tokens)
        return None

    def _matched_stop(self, seq: Sequence) -> str | None:
        # A stop string of n characters spans at most n tokens; one more covers a token that
        # only partly belongs to it. Any match must involve the newest token (else it had
        # matched a step earlier), so a short tail suffices.
        window = max(len(s) for s in seq.sampling.stop) + 1
        tail = self.decode_tail(seq.output_ids[-window:])
        return next((s for s in seq.sampling.stop if s and s in tail), None)

    # -- leaving ---------------------------------------------------------------------------
    def abort(self, rids: Iterable[str]) -> list[Sequence]:
        """Drop the sequences of `rids` that are here and free their blocks now."""
        wanted = set(rids)
        aborted = [seq for seq in self.unfinished if seq.rid in wanted]
        for seq in aborted:
            queue = self.waiting if seq.status == SequenceStatus.WAITING else self.running
            queue.remove(seq)
            self.block_manager.deallocate(seq)
            seq.status, seq.finish = SequenceStatus.FINISHED, ABORTED
        return aborted

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish = SequenceStatus.FINISHED, reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
