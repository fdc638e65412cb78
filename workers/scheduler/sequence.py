"""One request inside the scheduler: its token ids, KV blocks and publishing progress.

Pure Python (no torch, no redis): the core, the loop and the model runner all read it.
"""

from __future__ import annotations

from enum import Enum, auto

from shared.protocol import DetokParams, FinishReason, SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


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
    ) -> None:
        self.rid = rid
        self.status = SequenceStatus.WAITING
        # Prompt followed by the output: a prefill (or a recompute after preemption) runs
        # over all of it, a decode step over the last one.
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.epoch = epoch
        self.entry_id = entry_id  # the stream entry to ack once the request finished
        self.detok = detok
        # How many output ids already went out on the token channel (the next entry's seq).
        self.num_published = 0
        self.finish: FinishReason | None = None

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
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def unpublished_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens + self.num_published :]
