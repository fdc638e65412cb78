"""In-process request records of the api: what a route asks for (GenerateReq), what the
TokenizerManager tracks per rid (ReqState), and what a waiter hands back (ReqOutput)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from shared import protocol


@dataclass
class GenerateReq:
    """One generation request after HTTP parsing, before tokenization."""

    rid: str
    prompt: str | list[int]
    sampling: protocol.SamplingParams  # its max_new_tokens is replaced by `max_new_tokens`
    max_new_tokens: int | None  # None = whatever the context leaves after the prompt
    stream: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class ReqState:
    """Everything the api holds for one live rid (SGLang's ReqState).

    The listener appends text deltas to `out_list` and ids to `output_ids`, then sets `event`;
    the waiter drains `out_list` into `text`. `last_output_offset` counts the ids already
    handed to the client; `epoch`/`next_seq` drop stale owners and duplicates."""

    obj: GenerateReq
    index: int  # position in its batch
    prompt_tokens: int
    created_time: float = field(default_factory=time.time)
    last_time: float = field(default_factory=time.monotonic)  # last sign of life
    out_list: list[str] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_time: float = 0.0
    finished_time: float = 0.0
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    last_output_offset: int = 0
    epoch: int = 0
    next_seq: int = 0  # the seq the next entry should start at
    finish_reason: protocol.FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def rid(self) -> str:
        return self.obj.rid

    def finish(self, reason: protocol.FinishReason) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finished_time = time.time()
        self.completion_tokens = max(self.completion_tokens, len(self.output_ids))
        self.event.set()

    def take_output(self) -> ReqOutput:
        """Drain the pending deltas into one output (cumulative text/ids plus the delta)."""
        delta = "".join(self.out_list)
        self.out_list.clear()
        self.text += delta
        new_ids = self.output_ids[self.last_output_offset :]
        self.last_output_offset = len(self.output_ids)
        end = self.finished_time if self.finished else time.time()
        return ReqOutput(
            rid=self.rid,
            index=self.index,
            text=self.text,
            delta=delta,
            output_ids=list(self.output_ids),
            new_ids=new_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=max(self.completion_tokens, len(self.output_ids)),
            cached_tokens=self.cached_tokens,
            e2e_latency=end - self.created_time,
        )


@dataclass
class ReqOutput:
    rid: str
    index: int
    text: str  # cumulative
    delta: str  # new since this request's previous output
    output_ids: list[int]  # cumulative
    new_ids: list[int]
    finish_reason: protocol.FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float

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
        return {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(self.e2e_latency, 6),
        }

    def to_dict(self) -> dict[str, Any]:
        """SGLang's /generate output: {text, output_ids, meta_info}."""
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info()}
