"""Streaming responses as SSE events, one renderer per route kind (/generate, OpenAI
completions, OpenAI chat), built from the response's StreamSpec alone so that any replica can
go on rendering a re-attached stream exactly as the original replica would have.

A renderer turns each output into events and marks each event with what it covers (the
member, the seq after it, its token count, whether it finished the member, and the
completion logprob text offset): the log stores the marks, and `restore` + `seed` rebuild
the renderer's and the members' state from them after a takeover."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from api import sse
from api.errors import error_body
from api.inputs import openai_finish_reason, tool_calls_out, tool_finish_reason
from api.logprob_log import LogprobLog
from api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    echo_text,
    sglang_logprobs,
)
from api.reasoning import ReasoningStream
from api.req_state import ReqOutput, ReqState
from api.schemas.openai import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionLogprobs,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ToolCallDelta,
    UsageInfo,
)
from api.stream_spec import StreamSpec
from api.tools import ToolCall, ToolStream

TokenTexts = Callable[[Sequence[int]], list[str]]


class Mark(msgspec.Struct, array_like=True):
    """What one event covers of one member (choice or batch item)."""

    index: int
    seq: int  # the member's next seq after this event
    completion_tokens: int
    done: bool  # the event carried the member's finish
    offset: int = 0  # completions: text offset of the member's next logprob token


@dataclass(frozen=True)
class Event:
    data: bytes  # `data: ...\n\n`
    mark: Mark | None = None
    # What the log keeps instead of `data` (a cumulative chunk's delta form), rebuilt into
    # `data` by the renderer's `expand`; None: the log keeps `data`.
    compact: bytes | None = None


class Logged(Protocol):
    """A logged event as `expand` reads it (api.event_log.EventRecord)."""

    @property
    def data(self) -> bytes: ...
    @property
    def compact(self) -> bool: ...


class Counted(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


@dataclass(frozen=True)
class Counts:
    index: int
    prompt_tokens: int
    completion_tokens: int


@dataclass
class OpenAIHead:
    """The id/created/model triple of every OpenAI response and chunk."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def usage_of(outputs: Iterable[Counted], n: int = 1) -> UsageInfo:
    """Usage of a request's outputs; with n samples per prompt a prompt counts once."""
    items = list(outputs)
    prompt = sum(o.prompt_tokens for o in items if o.index % n == 0)
    completion = sum(o.completion_tokens for o in items)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def native_output(out: ReqOutput, texts: TokenTexts) -> dict[str, Any]:
    """SGLang's {text, output_ids, meta_info} (with logprob fields when asked for)."""
    incremental = out.req.incremental
    chunk = out.to_dict(incremental)
    if out.logprobs is not None:
        chunk["meta_info"].update(sglang_logprobs(out, texts, incremental))
    return chunk


class Renderer:
    """Events of one streaming response; subclasses say how an output becomes a chunk."""

    openai = False

    def __init__(self, spec: StreamSpec, texts: TokenTexts) -> None:
        self.spec = spec
        self.texts = texts

    def opening(self) -> list[Event]:
        return []

    def render(self, out: ReqOutput) -> list[Event]:
        raise NotImplementedError

    def closing(self) -> list[Event]:
        return [Event(sse.DONE)]

    def restore(self, marks: dict[int, Mark]) -> None:
        """Take up the state that the logged events `marks` (each member's last) left."""

    def seed(self, state: ReqState, data: bytes) -> None:
        """Seed a member's new state from its last logged event (`data`)."""

    def seed_text(self, index: int, text: str) -> None:
        """A member's text so far (chat parsers; api.reattach)."""

    def expand(self, records: Sequence[Logged]) -> list[bytes]:
        """Each logged event as it was sent."""
        return [r.data for r in records]

    @staticmethod
    def mark(out: ReqOutput, offset: int = 0) -> Mark:
        return Mark(out.index, out.seq, out.completion_tokens, out.finished, offset)

    def errors(self, out: ReqOutput) -> list[Event]:
        """A server-side failure (timeout, Redis outage, dead letter) also ends the member
        with an error event, in the route's error shape."""
        status = out.error_status
        if status is None:
            return []
        reason = out.finish_reason
        message = reason.message if reason and reason.message else "Request failed."
        return [Event(sse.event(error_body("", status, message, openai=self.openai)))]


class NativeRenderer(Renderer):
    """/generate: cumulative chunks (or deltas), a batch's tagged with their index."""

    def __init__(self, spec: StreamSpec, texts: TokenTexts) -> None:
        super().__init__(spec, texts)
        self.frozen_input: dict[int, dict[str, Any]] = {}  # restored input logprob fields

    def render(self, out: ReqOutput) -> list[Event]:
        chunk = native_output(out, self.texts)
        frozen = self.frozen_input.get(out.index)
        if frozen:
            chunk["meta_info"].update(frozen)
        if not self.spec.is_single:
            chunk["index"] = out.index
        compact = None if self.spec.incremental else self._delta(out)
        return [Event(sse.event(chunk), self.mark(out), compact), *self.errors(out)]

    def _delta(self, out: ReqOutput) -> bytes:
        """A cumulative chunk as the log keeps it: what is new in it (the whole chunk again
        each time would make the log quadratic in the output's length)."""
        delta = out.to_dict(incremental=True)
        if out.logprobs is not None:
            delta["meta_info"].update(sglang_logprobs(out, self.texts, True))
        if not self.spec.is_single:
            delta["index"] = out.index
        return msgspec.json.encode(delta)

    def expand(self, records: Sequence[Logged]) -> list[bytes]:
        """Rebuild cumulative chunks from their deltas, member by member, exactly as sent:
        text, ids and output logprobs joined, the input logprobs of the member's first."""
        sums: dict[int, dict[str, Any]] = {}
        out = []
        for record in records:
            if not record.compact:
                out.append(record.data)
                continue
            delta = json.loads(record.data)
            index = delta.get("index", 0)
            total = sums.setdefault(index, {"text": "", "output_ids": [], "meta_info": {}})
            total["text"] += delta["text"]
            total["output_ids"] += delta["output_ids"]
            meta = total["meta_info"]
            for key, value in delta["meta_info"].items():
                if key.startswith("output_"):
                    meta[key] = meta.get(key, []) + value
                elif not key.startswith("input_") or key not in meta:
                    meta[key] = value
            out.append(sse.event(total if "index" not in delta else {**total, "index": index}))
        return out

    def seed(self, state: ReqState, data: bytes) -> None:
        if self.spec.incremental:
            return  # deltas: nothing before the seq is shown again
        chunk = json.loads(data.removeprefix(b"data: "))
        meta = chunk["meta_info"]
        state.text = chunk["text"]
        state.output_ids = list(chunk["output_ids"])
        state.last_output_offset = len(state.output_ids)
        if state.logprobs is not None:
            state.logprobs = _log_from_meta(meta)
        self.frozen_input[state.index] = {k: v for k, v in meta.items() if k.startswith("input_")}


def _log_from_meta(meta: dict[str, Any]) -> LogprobLog:
    """The output logprobs of a cumulative chunk's meta_info, as the log held them."""
    log = LogprobLog()
    log.values = [t[0] for t in meta.get("output_token_logprobs", [])]
    empty: list[list[Any]] = [[] for _ in log.values]
    tops = meta.get("output_top_logprobs") or empty
    log.top_ids = [[t[1] for t in row] for row in tops]
    log.top_values = [[t[0] for t in row] for row in tops]
    requested = meta.get("output_token_ids_logprobs") or empty
    log.requested = [[t[0] for t in row] for row in requested]
    return log


class OpenAIRenderer(Renderer):
    """OpenAI chunks: one choice per chunk, continuous usage, a final usage chunk."""

    openai = True
    chunk_type: type[ChatCompletionChunk] | type[CompletionStreamResponse]

    def __init__(self, spec: StreamSpec, texts: TokenTexts) -> None:
        super().__init__(spec, texts)
        self.latest: dict[int, Counts] = {}  # per choice, for usage

    def choice(self, out: ReqOutput) -> Any:
        raise NotImplementedError

    def offset(self, index: int) -> int:
        return 0

    def event(self, choices: list[Any], usage: UsageInfo | None = None) -> bytes:
        spec = self.spec
        chunk = self.chunk_type(id=spec.head_id, created=spec.created, model=spec.model,
                                choices=choices)  # fmt: skip
        if usage is not None:
            chunk.usage = usage
        return sse.event(chunk.model_dump_json())

    def render(self, out: ReqOutput) -> list[Event]:
        self.latest[out.index] = Counts(out.index, out.prompt_tokens, out.completion_tokens)
        if not out.delta and not out.finished and (out.logprobs is None or out.start == out.end):
            return []  # nothing new to show
        usage = usage_of(self.latest.values(), self.spec.n) if self.spec.continuous_usage else None
        data = self.event([self.choice(out)], usage)
        return [Event(data, self.mark(out, self.offset(out.index))), *self.errors(out)]

    def closing(self) -> list[Event]:
        events = []
        if self.spec.include_usage and self.latest:
            events.append(Event(self.event([], usage_of(self.latest.values(), self.spec.n))))
        return [*events, *super().closing()]

    def restore(self, marks: dict[int, Mark]) -> None:
        for index, mark in marks.items():
            prompt = self.spec.members[index].prompt_tokens
            self.latest[index] = Counts(index, prompt, mark.completion_tokens)


class CompletionRenderer(OpenAIRenderer):
    chunk_type = CompletionStreamResponse

    def __init__(self, spec: StreamSpec, texts: TokenTexts) -> None:
        super().__init__(spec, texts)
        self.offsets: dict[int, int] = {}  # per choice: text offset of its next token

    def choice(self, out: ReqOutput) -> CompletionStreamChoice:
        echo = self.spec.echo and out.first  # the prompt leads the choice's first chunk
        logprobs = None
        if out.logprobs is not None and echo:
            body = echo_logprobs(out, self.texts)
            ends = [o + len(t) for o, t in zip(body["text_offset"], body["tokens"], strict=True)]
            self.offsets[out.index] = ends[-1] if ends else 0
            logprobs = CompletionLogprobs(**body)
        elif out.logprobs is not None:
            body, self.offsets[out.index] = completion_logprobs(
                out, self.texts, out.start, self.offsets.get(out.index, 0)
            )
            logprobs = CompletionLogprobs(**body)
        text = echo_text(out, self.texts) + out.delta if echo else out.delta
        return CompletionStreamChoice(
            index=out.index, text=text, logprobs=logprobs,
            finish_reason=openai_finish_reason(out),
        )  # fmt: skip

    def offset(self, index: int) -> int:
        return self.offsets.get(index, 0)

    def restore(self, marks: dict[int, Mark]) -> None:
        super().restore(marks)
        self.offsets = {index: mark.offset for index, mark in marks.items()}


class ChatRenderer(OpenAIRenderer):
    chunk_type = ChatCompletionChunk

    def __init__(self, spec: StreamSpec, texts: TokenTexts) -> None:
        super().__init__(spec, texts)
        # Per choice, when tools or a reasoning parser are on.
        self.tool_streams: dict[int, ToolStream] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def opening(self) -> list[Event]:
        """Each choice of a stream opens with the assistant role."""
        role = DeltaMessage(role="assistant", content="")
        return [
            Event(self.event([ChatStreamChoice(index=index, delta=role)]))
            for index in range(len(self.spec.members))
        ]

    def choice(self, out: ReqOutput) -> ChatStreamChoice:
        logprobs = None
        if out.logprobs is not None:
            logprobs = ChatLogprobs(**chat_logprobs(out, self.texts, out.start))
        if self.spec.tool_parser or self.spec.reasoning_parser:
            return self._parsed_choice(out, logprobs)
        return ChatStreamChoice(
            index=out.index,
            delta=DeltaMessage(content=out.delta) if out.delta else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=openai_finish_reason(out),
        )

    def seed_text(self, index: int, text: str) -> None:
        """After a takeover: the member's text up to its last logged event goes through its
        parsers again, so they hold what the first replica held back (all the rest was
        shown, and is not shown again)."""
        self._parse(index, text, False)

    def _parse(self, index: int, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content) to show of new text, and the calls once finished."""
        spec, reasoning, content = self.spec, "", text
        if spec.reasoning_parser:
            thinking = self.reasoning_streams.setdefault(
                index, ReasoningStream(spec.reasoning_parser))
            reasoning, content = thinking.feed(content, finished)
        calls: list[ToolCall] = []
        if spec.tool_parser:
            stream = self.tool_streams.setdefault(index, ToolStream(spec.tool_parser))
            content = stream.feed(content, finished)
            calls = stream.calls if finished else []
        return reasoning, content, calls

    def _parsed_choice(self, out: ReqOutput, logprobs: ChatLogprobs | None) -> ChatStreamChoice:
        """Thinking as reasoning_content deltas; then text until a call may begin, and the
        calls in one delta when the choice finishes."""
        reasoning, content, calls = self._parse(out.index, out.delta, out.finished)
        deltas = [
            ToolCallDelta(index=i, **call.model_dump())
            for i, call in enumerate(tool_calls_out(out.rid, calls) or [])
        ]
        delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                             tool_calls=deltas or None)  # fmt: skip
        return ChatStreamChoice(index=out.index, delta=delta, logprobs=logprobs,
                                finish_reason=tool_finish_reason(out, calls))  # fmt: skip


RENDERERS: dict[str, type[Renderer]] = {
    "generate": NativeRenderer,
    "completion": CompletionRenderer,
    "chat": ChatRenderer,
}


def make_renderer(spec: StreamSpec, texts: TokenTexts) -> Renderer:
    return RENDERERS[spec.kind](spec, texts)
