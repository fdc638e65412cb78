"""In-process request records of the api: what a route asks for (GenerateReq), what the
TokenizerManager tracks per rid (ReqState), and what a waiter hands back (ReqOutput)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from api.logprob_log import LogprobLog
from shared import protocol

logger = logging.getLogger(__name__)

# A cross-encoder input: (query, document).
TextPair = tuple[str, str]


class Superseded(Exception):
    """Another attachment (a re-attach on any replica) took the request over: its waiter
    here ends quietly, neither aborting nor releasing it."""


@dataclass
class GenerateReq:
    """One generation (or embedding) request after HTTP parsing, before tokenization."""

    rid: str
    prompt: str | list[int] | TextPair
    sampling: protocol.SamplingParams  # its max_new_tokens is replaced by `max_new_tokens`
    max_new_tokens: int | None  # None = whatever the context leaves after the prompt
    stream: bool = False
    # Stream deltas only: the cumulative text is never built (OpenAI streams, and /generate
    # under --incremental-streaming-output).
    incremental: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logprobs: protocol.LogprobRequest | None = None
    return_text_in_logprobs: bool = False
    embed: bool = False
    openai: bool = False  # errors in OpenAI's words (context length)
    priority: int = 0  # SGLang's: schedulers start higher values first
    timeout: float | None = None  # seconds from submission; past it the request ends (504)
    # Set by tokenization.
    input_ids: list[int] = field(default_factory=list, repr=False)
    token_type_ids: list[int] | None = field(default=None, repr=False)


@dataclass
class ReqState:
    """Everything the api holds for one live rid (SGLang's ReqState).

    The listener appends text deltas to `out_list`, ids to `output_ids` (and logprobs to
    `logprobs`, one position per id), then sets `event`; the waiter drains `out_list`.
    Nothing cumulative is copied per step: `text` is built only for outputs that carry it,
    and outputs refer to the append-only lists by offsets. `epoch`/`next_seq` drop stale
    owners and duplicates."""

    obj: GenerateReq
    index: int  # position in its batch
    prompt_tokens: int
    created_time: float = field(default_factory=time.time)
    last_time: float = field(default_factory=time.monotonic)  # last sign of life
    out_list: list[str] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_time: float = 0.0
    last_token_time: float = 0.0  # when tokens last arrived (api.metrics: inter-token latency)
    finished_time: float = 0.0
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    last_output_offset: int = 0
    epoch: int = 0
    next_seq: int = 0  # the seq the next entry should start at
    finish_reason: protocol.FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: LogprobLog | None = None
    embedding: list[float] | None = None
    weight_version: str | None = None  # the weights that produced it (its finish entry's)
    num_outputs: int = 0
    # Streaming responses: the rid of the response's event log and the attachment that
    # appends to it (None: not streaming). `superseded`: another attachment took the request
    # over, end quietly; `released`: left to the fleet at shutdown (re-attach or reap).
    stream_rid: str | None = None
    attach_id: str | None = None
    superseded: bool = False
    released: bool = False
    # Gaps (DESIGN §4.4): entries past a gap wait in `held` until a resend (asked for at
    # `resend_at`, monotonic; 0 = none pending) or a refill from the id log fills it.
    held: list[protocol.TextEntry] = field(default_factory=list, repr=False)
    resend_at: float = 0.0
    # Entries surely went elsewhere (a re-attach, a lost subscription): the id log may fill
    # them at once, even for a request whose entries carry more than ids (api.gaps).
    entries_lost: bool = False
    refill_every: float = 0.0  # the id log is read again after this long (backs off)
    finish_seen: protocol.FinishReason | None = None  # an applied entry's finish

    def __post_init__(self) -> None:
        if self.obj.logprobs is not None and self.logprobs is None:
            self.logprobs = LogprobLog()

    @property
    def rid(self) -> str:
        return self.obj.rid

    def accept(self, entry: protocol.TextEntry) -> bool:
        """Take one entry of the engine; True when it brought news (text, ids, a finish).
        Fenced by owner epoch and seq: a stale owner's entries and duplicates are dropped (a
        duplicate's finish still counts); an entry past a gap waits in `held` until the gap
        is filled (`release_held` gives up on the gap)."""
        if entry.epoch < self.epoch:
            logger.info("dropping stale epoch rid=%s epoch=%d<%d", entry.rid, entry.epoch,
                        self.epoch)  # fmt: skip
            return False
        self.epoch = entry.epoch
        if entry.seq > self.next_seq:  # pub/sub lost a message (DESIGN §4.4)
            if not self.held:
                logger.warning("gap rid=%s expected seq=%d got %d", entry.rid, self.next_seq,
                               entry.seq)  # fmt: skip
            self.held.append(entry)
            return False
        news = self._take(entry)
        while self.held and min(e.seq for e in self.held) <= self.next_seq:
            nxt = min(self.held, key=lambda e: e.seq)
            self.held.remove(nxt)
            news = self._take(nxt) or news
        return news

    def release_held(self) -> bool:
        """Give up on the gap: apply the held entries in order, skipping what is missing."""
        held, self.held = sorted(self.held, key=lambda e: e.seq), []
        news = False
        for entry in held:
            news = self._take(entry) or news
        return news

    def _take(self, entry: protocol.TextEntry) -> bool:
        """Apply an entry (one that starts before next_seq is a duplicate; after it, one
        whose gap was given up on)."""
        self.weight_version = entry.weight_version or self.weight_version
        if entry.seq < self.next_seq:
            logger.debug("duplicate rid=%s seq=%d<%d", entry.rid, entry.seq, self.next_seq)
            if entry.finish is not None:
                self.finish_seen = entry.finish
            return entry.finish is not None
        self.out_list.append(entry.text)
        self.output_ids.extend(entry.token_ids)
        self.next_seq = entry.seq + len(entry.token_ids)
        self.completion_tokens = max(self.completion_tokens, entry.completion_tokens)
        self.cached_tokens = entry.cached_tokens
        if self.logprobs is not None:
            self.logprobs.extend(entry.output_logprobs, len(entry.token_ids))
            if entry.input_logprobs is not None and self.logprobs.input is None:
                self.logprobs.input = entry.input_logprobs
        if entry.embedding is not None:
            self.embedding = entry.embedding
        if entry.finish is not None:
            self.finish_seen = entry.finish
        return True

    def finish(self, reason: protocol.FinishReason) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finished_time = time.time()
        self.completion_tokens = max(self.completion_tokens, len(self.output_ids))
        self.event.set()

    def take_output(self) -> ReqOutput:
        """Drain the pending deltas into one output (the delta, the cumulative text unless
        the request streams incrementally, and offsets into the id and logprob lists)."""
        delta = "".join(self.out_list)
        self.out_list.clear()
        if not (self.obj.incremental and self.obj.stream):
            self.text += delta
        start, end = self.last_output_offset, len(self.output_ids)
        self.last_output_offset = end
        self.num_outputs += 1
        finish_time = self.finished_time if self.finished else time.time()
        return ReqOutput(
            req=self.obj,
            index=self.index,
            text=self.text,
            delta=delta,
            ids=self.output_ids,
            start=start,
            end=end,
            first=self.num_outputs == 1,
            seq=self.next_seq,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=max(self.completion_tokens, end),
            cached_tokens=self.cached_tokens,
            e2e_latency=finish_time - self.created_time,
            logprobs=self.logprobs,
            embedding=self.embedding,
            weight_version=self.weight_version,
        )


@dataclass
class ReqOutput:
    req: GenerateReq
    index: int
    text: str  # cumulative ("" for incremental streams)
    delta: str  # new since this request's previous output
    ids: list[int] = field(repr=False)  # the request's append-only output ids
    start: int  # ids[start:end] are new in this output
    end: int
    first: bool  # the request's first output
    seq: int  # the seq of the request's next entry (what this output covers up to)
    finish_reason: protocol.FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    logprobs: LogprobLog | None = field(default=None, repr=False)
    embedding: list[float] | None = field(default=None, repr=False)
    weight_version: str | None = None

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def output_ids(self) -> list[int]:
        return self.ids[: self.end]

    @property
    def new_ids(self) -> list[int]:
        return self.ids[self.start : self.end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def error_status(self) -> int | None:
        """The HTTP status of an abort that is a server-side failure (timeouts, dead letters)."""
        reason = self.finish_reason
        if reason is not None and reason.type == "abort" and reason.status_code:
            return reason.status_code if reason.status_code >= 400 else None
        return None

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info; `weight_version` once known (the finish entry brings it)."""
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(self.e2e_latency, 6),
        }
        if self.weight_version is not None:
            meta["weight_version"] = self.weight_version
        return meta

    def to_dict(self, incremental: bool = False) -> dict[str, Any]:
        """SGLang's /generate output: {text, output_ids, meta_info}; with `incremental`, the
        text and ids new in this output only."""
        if incremental:
            return {"text": self.delta, "output_ids": self.new_ids, "meta_info": self.meta_info()}
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info()}
