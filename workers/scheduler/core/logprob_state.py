"""Logprobs of one request as the engine computes them (pure Python; no torch, no redis).

Output logprobs are kept per output index, so a sample that is thrown away and redone (a
partial prefill chunk, a recompute after preemption) overwrites its slot instead of adding
one. Prompt logprobs run from prompt token `max(start_len, 1)` to the prompt's end (token 0
has no context, so none). They are computed once, chunk by chunk, in prompt order; the
prefix cache stops short of them (`num_cacheable_tokens`), and a position that was still
never computed would hold NaN, which the api shows as null.
"""

from __future__ import annotations

import sys

from shared.protocol import LogprobRequest, Logprobs


class LogprobState:
    def __init__(self, request: LogprobRequest, num_prompt_tokens: int) -> None:
        self.request = request
        self.num_prompt_tokens = num_prompt_tokens
        self.output = Logprobs()
        self.input: Logprobs | None = Logprobs() if request.start_len >= 0 else None
        # First prompt token that has a logprob.
        self.input_start = min(max(request.start_len, 1), num_prompt_tokens)

    # -- output ----------------------------------------------------------------------------
    def set_output(
        self,
        index: int,
        logprob: float,
        top: tuple[list[int], list[float]] | None,
        requested: list[float] | None,
    ) -> None:
        """The logprobs of output token `index` (`top` = (ids, logprobs) if top_n > 0,
        `requested` in request.token_ids order if any were asked for)."""
        out = self.output
        for values in (out.token_logprobs, out.top_ids, out.top_logprobs, out.requested_logprobs):
            del values[index:]
        self._pad(out, index)
        out.token_logprobs.append(logprob)
        if top is not None:
            out.top_ids.append(top[0])
            out.top_logprobs.append(top[1])
        if requested is not None:
            out.requested_logprobs.append(requested)

    def output_slice(self, start: int, end: int) -> Logprobs:
        """The output positions [start, end) (one entry's new tokens)."""
        out = self.output
        return Logprobs(
            token_logprobs=out.token_logprobs[start:end],
            top_ids=out.top_ids[start:end],
            top_logprobs=out.top_logprobs[start:end],
            requested_logprobs=out.requested_logprobs[start:end],
        )

    # -- input -----------------------------------------------------------------------------
    @property
    def next_input_token(self) -> int:
        """The next prompt token whose logprob is missing (num_prompt_tokens when done)."""
        if self.input is None:
            return self.num_prompt_tokens
        return self.input_start + len(self.input.token_logprobs)

    @property
    def num_cacheable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: their positions' logits
        are not computed, so none whose prompt logprob is still wanted (SGLang too caps
        prefix reuse at logprob_start_len)."""
        if self.next_input_token >= self.num_prompt_tokens:
            return sys.maxsize
        return self.next_input_token - 1

    def add_input(
        self,
        first_token: int,
        logprobs: list[float],
        top: tuple[list[list[int]], list[list[float]]] | None,
        requested: list[list[float]] | None,
    ) -> None:
        """Logprobs of prompt tokens first_token, first_token + 1, ... (in prompt order).
        Tokens before `first_token` that are still missing become NaN."""
        lp = self.input
        if lp is None:
            return
        skip = max(0, self.next_input_token - first_token)  # already there (a recompute)
        self._pad(lp, first_token - self.input_start)
        lp.token_logprobs.extend(logprobs[skip:])
        if top is not None:
            lp.top_ids.extend(top[0][skip:])
            lp.top_logprobs.extend(top[1][skip:])
        if requested is not None:
            lp.requested_logprobs.extend(requested[skip:])

    def _pad(self, lp: Logprobs, length: int) -> None:
        """Fill positions up to `length` that were never computed: NaN, empty lists."""
        missing = length - len(lp.token_logprobs)
        if missing <= 0:
            return
        lp.token_logprobs.extend([float("nan")] * missing)
        if self.request.top_n > 0:
            lp.top_ids.extend([] for _ in range(missing))
            lp.top_logprobs.extend([] for _ in range(missing))
        if self.request.token_ids:
            lp.requested_logprobs.extend([] for _ in range(missing))
