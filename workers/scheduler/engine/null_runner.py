"""The null engine (`redserve scheduler --engine null`): a test and benchmark tool, not a
model. The scheduler loop, the core's batching and paged KV bookkeeping, every Redis call
and every output message are the real scheduler's; only the forward is taken out. A step
sleeps a fixed time (blocking, as a forward does) and gives each sampling sequence a token
that is a deterministic function of (prompt, position): the same request gets the same
output on any scheduler, after any crash and resume. Load on the fabric (Redis, the
detokenizers, the api replicas) can then be measured on machines where the model would hide
it (bench/fabric.py).

What it cannot do, it says so rather than pretend: no grammars (the loop answers 400 for
structured output without a grammar compiler); logprobs are the chosen token's (0.0: it is
certain) and no others; an embedding is a unit vector derived from the prompt alone."""

from __future__ import annotations

import hashlib
import math
import time
import weakref

from workers.scheduler.core.sequence import Sequence

_MASK = (1 << 64) - 1
NO_LOGPROB = -1e4  # a token the null engine would never pick


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def prompt_digest(prompt_ids: list[int]) -> int:
    raw = b"".join(i.to_bytes(4, "little", signed=False) for i in prompt_ids)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def null_token(digest: int, position: int, first_id: int, vocab_size: int) -> int:
    """The token at output `position` of a prompt whose digest is `digest`: one of
    [first_id, vocab_size), so never a special token when first_id is past them."""
    return first_id + _mix(digest ^ _mix(position)) % (vocab_size - first_id)


class NullModelRunner:
    def __init__(
        self,
        vocab_size: int,
        num_kv_blocks: int,
        block_size: int,
        step_s: float,
        first_token_id: int = 0,
        hidden_size: int = 64,
        max_positions: int = 2048,
    ) -> None:
        if not 0 <= first_token_id < vocab_size:
            raise ValueError(f"first_token_id {first_token_id} outside a vocab of {vocab_size}")
        self.vocab_size, self.first_token_id = vocab_size, first_token_id
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.step_s, self.hidden_size = step_s, hidden_size
        self.max_positions = max_positions
        self.eos_token_ids: frozenset[int] = frozenset()  # it never emits them anyway
        # A prompt's digest, computed once per sequence (dropped with it).
        self._digests: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def run(self, seqs: list[Sequence]) -> list[int]:
        """Sleep one step, then the next token of each sequence with `will_sample`."""
        if self.step_s > 0:
            time.sleep(self.step_s)
        tokens = []
        for seq in seqs:
            if not seq.will_sample:
                continue  # a prefill chunk short of its prompt's end: nothing to sample
            digest = self._digest(seq)
            token = null_token(digest, seq.num_completion_tokens, self.first_token_id,
                               self.vocab_size)  # fmt: skip
            if seq.embed:
                seq.embedding = self._embedding(digest)
            if seq.logprobs is not None:
                self._record_logprobs(seq, token)
            tokens.append(token)
        return tokens

    def _digest(self, seq: Sequence) -> int:
        digest = self._digests.get(seq)
        if digest is None:
            digest = self._digests[seq] = prompt_digest(seq.token_ids[: seq.num_prompt_tokens])
        return digest

    def _embedding(self, digest: int) -> list[float]:
        raw = [(_mix(digest ^ _mix(i)) / _MASK) * 2 - 1 for i in range(self.hidden_size)]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]

    @staticmethod
    def _record_logprobs(seq: Sequence, token: int) -> None:
        state = seq.logprobs
        assert state is not None
        request = state.request
        top = ([token], [0.0]) if request.top_n > 0 else None
        wanted = request.token_ids
        requested = [0.0 if i == token else NO_LOGPROB for i in wanted] if wanted else None
        state.set_output(seq.num_completion_tokens, 0.0, top, requested)
