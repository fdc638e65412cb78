"""OpenAI's Responses API on top of the chat pipeline: a request becomes a chat request
(instructions, input items, function tools, text.format), and a finished chat output becomes
a Response object (message, function_call and reasoning items). Streams are built by
ResponseEvents from the same deltas the chat stream parses (reasoning, tool calls).
Stateless: nothing is stored, so `previous_response_id` is refused.
"""

from __future__ import annotations

import time
from typing import Any

from api.errors import BadRequest
from api.reasoning import ReasoningStream
from api.schemas.openai import ChatCompletionRequest
from api.schemas.responses import ResponsesRequest
from api.tools import ToolCall, ToolStream, call_id

_ROLES = ("user", "system", "developer", "assistant")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `body`."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for item in items:
        messages.append(_message(item))
    chat: dict[str, Any] = {
        "messages": messages, "stream": body.stream, "temperature": body.temperature,
        "top_p": body.top_p, "max_tokens": body.max_output_tokens, "rid": body.rid,
        "timeout": body.timeout, "parallel_tool_calls": body.parallel_tool_calls,
    }  # fmt: skip
    if body.tools:
        chat["tools"] = [_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = (body.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        schema = {k: fmt.get(k) for k in ("name", "schema", "strict", "description")}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})


def _message(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": _text(item.get("output"))}  # fmt: skip
    if kind != "message" or item.get("role") not in _ROLES:
        raise BadRequest(f"Unsupported input item: {ascii(kind)[:40]}.", param="input")
    return {"role": item["role"], "content": _text(item.get("content"))}


def _text(content: Any) -> str:
    """Text of a message's content: a string or input_text / output_text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest("content must be a string or a list of parts.", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise BadRequest("Only input_text and output_text parts are supported.",
                             param="input")  # fmt: skip
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise BadRequest(f"Unsupported tool type: {ascii(tool.get('type'))[:40]}.", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# -- the Response object ---------------------------------------------------------------------


def message_item(rid: str, text: str, done: bool = True) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": f"msg_{rid}", "status": "completed" if done else
            "in_progress", "role": "assistant", "content": [part] if done else []}  # fmt: skip


def call_item(rid: str, index: int, call: ToolCall) -> dict[str, Any]:
    cid = call_id(rid, index)
    return {"type": "function_call", "id": f"fc_{cid}", "call_id": cid, "name": call.name,
            "arguments": call.arguments, "status": "completed"}  # fmt: skip


def reasoning_item(rid: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def output_items(rid: str, reasoning: str | None, content: str | None,
                 calls: list[ToolCall]) -> list[dict[str, Any]]:  # fmt: skip
    items = [reasoning_item(rid, reasoning)] if reasoning else []
    if content or not calls:
        items.append(message_item(rid, content or ""))
    return items + [call_item(rid, i, c) for i, c in enumerate(calls)]


def response_object(
    body: ResponsesRequest, resp_id: str, created: int, model: str, output: list[dict[str, Any]],
    status: str = "completed", finish: Any = None, usage: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    incomplete = None
    if status == "incomplete":
        incomplete = {"reason": "max_output_tokens"}
    error = None
    if status == "failed":
        error = {"code": "server_error", "message": getattr(finish, "message", None) or "failed"}
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "error": error, "incomplete_details": incomplete,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}}, "store": False,
        "previous_response_id": None, "reasoning": body.reasoning, "user": body.user,
        "usage": usage,
    }  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens, "output_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


def status_of(finish: Any) -> str:
    if finish is None or finish.type == "stop":
        return "completed"
    return "incomplete" if finish.type == "length" else "failed"


class ResponseEvents:
    """The streaming events of one response, from its text deltas: created, in_progress,
    the message item with output_text deltas, then at the finish the function_call items
    and completed (each event with its sequence_number)."""

    def __init__(self, body: ResponsesRequest, resp_id: str, model: str, rid: str,
                 tool_parser: str | None, thinking: str) -> None:  # fmt: skip
        self.body, self.resp_id, self.model, self.rid = body, resp_id, model, rid
        self.created = int(time.time())
        self.tools = ToolStream(tool_parser) if tool_parser else None
        self.thinking = ReasoningStream(thinking) if thinking else None
        self.seq = 0
        self.text = ""
        self.message_open = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        snapshot = response_object(self.body, self.resp_id, self.created, self.model, [],
                                   "in_progress")  # fmt: skip
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]  # fmt: skip

    def delta(self, text: str, finished: bool) -> tuple[list[dict[str, Any]], list[ToolCall]]:
        if self.thinking is not None:  # the thinking is left out of streams
            _, text = self.thinking.feed(text, finished)
        calls: list[ToolCall] = []
        if self.tools is not None:
            text = self.tools.feed(text, finished)
            calls = self.tools.calls if finished else []
        events = []
        if text:
            events += self._open_message()
            self.text += text
            events.append(self.event("response.output_text.delta", item_id=f"msg_{self.rid}",
                                     output_index=0, content_index=0, delta=text))  # fmt: skip
        return events, calls

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message_open:
            return []
        self.message_open = True
        item = message_item(self.rid, "", done=False)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=0,
                           content_index=0, part=part)]  # fmt: skip

    def closing(self, calls: list[ToolCall], finish: Any,
                usage_: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
        events = []
        if self.message_open or not calls:
            events += self._open_message()
            item = message_item(self.rid, self.text)
            part = item["content"][0]
            events += [
                self.event("response.output_text.done", item_id=item["id"], output_index=0,
                           content_index=0, text=self.text),
                self.event("response.content_part.done", item_id=item["id"], output_index=0,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=0, item=item),
            ]  # fmt: skip
        base = 1 if events else 0
        for i, call in enumerate(calls):
            item = call_item(self.rid, i, call)
            added = {**item, "arguments": "", "status": "in_progress"}
            events += [
                self.event("response.output_item.added", output_index=base + i, item=added),
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=base + i, delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=base + i, arguments=call.arguments),
                self.event("response.output_item.done", output_index=base + i, item=item),
            ]  # fmt: skip
        output = output_items(self.rid, None, self.text or None, calls)
        final = response_object(self.body, self.resp_id, self.created, self.model, output,
                                status_of(finish), finish, usage_)  # fmt: skip
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[final["status"]]  # fmt: skip
        return [*events, self.event(kind, response=final)]
