"""One request inside the scheduler: its token ids, KV blocks and publishing progress.

Pure Python (no torch, no redis): the core, the loop and the model runner all read it.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Protocol

from shared.protocol import DetokParams, FinishReason, LogprobRequest, SamplingParams
from workers.scheduler.core.logprob_state import LogprobState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class GrammarState(Protocol):
    """A constrained request's grammar (workers.scheduler.grammar.Constraint): the core only
    asks whether it compiled, feeds it the sampled tokens and asks whether it ended."""

    @property
    def ready(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...

    def accept(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


class Sequence:
    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        epoch: int = 1,
        entry_id: bytes = b"",
        detok: DetokParams | None = None,
        logprobs: LogprobRequest | None = None,
        embed: bool = False,
        priority: int = 0,
        deadline: float = 0.0,
        created_at: float = 0.0,
    ) -> None:
        self.rid = rid
        self.status = SequenceStatus.WAITING
        # Prompt followed by the output. A step computes the K/V of `num_new_tokens` of them
        # from `num_computed_tokens` on: prefill chunks, or a decode's last token; a
        # recompute after preemption starts again from 0 (or from a cached prefix).
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix hash of each full block of token_ids
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_new_tokens = 0  # tokens the scheduled step computes
        # Prompt tokens that the first prefill found in the prefix cache (reported).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.epoch = epoch
        self.entry_id = entry_id  # the stream entry to ack once the request finished
        self.detok = detok
        # How many output ids already went out on the token channel (the next entry's seq),
        # and how many there were when this owner took the request (resume, below).
        self.num_published = 0
        self.num_resumed = 0
        self.finish: FinishReason | None = None
        # Outputs besides the token ids (filled by the model runner).
        self.logprobs = LogprobState(logprobs, len(prompt_ids)) if logprobs else None
        self.embed = embed  # an embedding job: one prefill, no output tokens
        self.embedding: list[float] | None = None
        self.priority = priority  # higher starts first
        self.arrival = 0  # set by the core: the order among sequences of equal priority
        self.deadline = deadline  # unix time; 0 = none
        self.created_at = created_at  # unix time the api submitted it
        # Seconds from submission to this owner's first step (sent with the first entry).
        self.queue_time: float | None = None
        # Structured output: set by the loop when sampling.grammar is; the sampler masks by it.
        self.grammar: GrammarState | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence(rid={self.rid!r}, tokens={len(self)}, status={self.status.name})"

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def will_sample(self) -> bool:
        """Whether the scheduled step reaches the last token, so it samples the next one
        (a prefill chunk that stops short of the end does not)."""
        return self.num_new_tokens > 0 and self.num_new_tokens == self.num_uncomputed_tokens

    @property
    def prefill_only(self) -> bool:
        """Its prompt is its whole job: an embedding, or max_new_tokens 0 with prompt
        logprobs (scoring a text, as `echo` with `max_tokens: 0` asks)."""
        lp = self.logprobs
        scores = lp is not None and lp.request.start_len >= 0
        return self.embed or (self.sampling.max_new_tokens == 0 and scores)

    @property
    def is_ready(self) -> bool:
        """Whether it may start: its grammar (if any) compiled (one that failed never
        starts: Scheduler.fail_grammars ends it)."""
        return self.grammar is None or (self.grammar.ready and self.grammar.failure is None)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def resume(self, output_ids: list[int]) -> None:
        """Continue after `output_ids`, the output a previous owner already published: they
        are prefilled with the prompt (the prefix cache helps) and not published again."""
        self.token_ids += output_ids
        self.num_published = self.num_resumed = len(output_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def unpublished_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens + self.num_published :]
