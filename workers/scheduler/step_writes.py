"""A step's news as the fenced step script takes it: one TokenEntry per request that has
something to publish, and one TokenBatch per token shard that those entries touch. Pure."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

from shared import protocol
from shared.keys import Keys, shard_of
from shared.ownership import StepEntry
from workers.scheduler.core.sequence import Sequence

Batch = tuple[str, bytes, list[int]]  # channel, encoded TokenBatch, indices of its entries


def step_writes(
    seqs: Iterable[Sequence],
    worker_id: str,
    keys: Keys,
    num_shards: int,
    weight_version: str | None = None,
) -> tuple[list[StepEntry], list[Batch]]:
    """The entries of `seqs` (their unpublished news, and the finish of finished ones,
    stamped with `weight_version`) and the batches that carry them."""
    steps: list[StepEntry] = []
    members: dict[int, list[int]] = defaultdict(list)
    now = time.time()
    for seq in seqs:
        members[shard_of(seq.rid, num_shards)].append(len(steps))
        finished_at = now if seq.is_finished else 0.0
        entry = token_entry(seq, weight_version)
        steps.append(StepEntry(entry, seq.entry_id, seq.num_completion_tokens, finished_at))
    batches = [
        (keys.token_channel(shard), _batch(worker_id, [steps[i] for i in idx]), idx)
        for shard, idx in members.items()
    ]
    return steps, batches


def current_batches(
    worker_id: str, steps: list[StepEntry], batches: list[Batch], unsent: list[int], stale: set[int]
) -> list[tuple[str, bytes]]:
    """The batches the script did not publish (one of their entries was stale), rebuilt
    from their current entries only."""
    out = []
    for b in unsent:
        channel, _payload, idx = batches[b]
        current = [steps[i] for i in idx if i not in stale]
        if current:
            out.append((channel, _batch(worker_id, current)))
    return out


def _batch(worker_id: str, steps: list[StepEntry]) -> bytes:
    entries = [step.entry for step in steps]
    return protocol.encode(protocol.TokenBatch(worker_id=worker_id, entries=entries))


def token_entry(seq: Sequence, weight_version: str | None = None) -> protocol.TokenEntry:
    """What `seq` has not published yet, as one wire entry: its new ids from `seq`
    num_published on, their logprobs, and with this owner's first entry its detokenizer
    params (and with the request's first, its prompt logprobs); with the last, its finish
    and embedding."""
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
        detok=seq.detok if first == seq.num_resumed else None,
        output_logprobs=lp.output_slice(first, first + len(new_ids)) if lp else None,
        input_logprobs=lp.input if lp and first_out else None,
        embedding=seq.embedding if seq.is_finished else None,
        queue_time=seq.queue_time if first == seq.num_resumed else None,
        weight_version=weight_version if seq.is_finished else None,
    )
