"""Tool calling on /v1/chat/completions: the tools into the prompt, the call format into a
grammar, and the output back into OpenAI's `tool_calls`.

- Prompt: a chat template that knows tools gets them as `tools=` (and assistant `tool_calls`
  in the history as it expects them); one that does not (SmolLM2's) is taught the parser's
  call format and the tools' signatures in a system message, and sees earlier calls written
  in that format.
- Grammar: an xgrammar structural tag in the parser's format whose arguments follow each
  tool's parameter schema: `auto` lets free text run until the format's trigger, `required`
  is calls only (at least one), a named tool exactly that call; without `parallel_tool_calls`
  the first call ends the output. So even a small model returns valid arguments.
- Parsing: the parser (`--tool-call-parser`, SGLang's names) takes the calls out of the text;
  what is left is `content`. Streams show text until a call may begin (ToolStream), then
  the calls as one `tool_calls` delta when the choice finishes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from api.errors import BadRequest
from shared.protocol import Grammar


@dataclass(frozen=True)
class CallFormat:
    trigger: str  # where a call begins
    begin: str  # a call up to its arguments ({name}: the JSON-quoted tool name)
    end: str  # after the arguments
    args_key: str
    separator: str  # between parallel calls
    teach: str  # the system prompt's instruction, for templates that know no tools


FORMATS = {
    "hermes": CallFormat(
        "<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>",
        "arguments", "\n",
        "You may call one or more functions to assist with the user query. The function "
        "signatures are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>',
    ),
    "llama3": CallFormat(
        '{"name": ', '{{"name": {name}, "parameters": ', "}", "parameters", "; ",
        "You have access to the following functions:\n{tools}\nTo call a function, respond "
        'with a JSON object of the form {{"name": function name, "parameters": dictionary '
        "of argument name and its value}}.",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolSetup:
    """A chat request's tools, ready for the prompt and the output: `parser` is None when
    tools are off (none given, or tool_choice none)."""

    parser: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # for a template that knows tools; else empty
    grammar: Grammar | None
    forced: bool  # tool_choice required or a named tool


def setup_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], choice_sent: Any,
    parallel: bool, parser: str, template: str | None,
) -> ToolSetup:  # fmt: skip
    choice = check_tool_choice(tools, choice_sent)
    native = "tools" in (template or "")
    active = tools if choice else []
    messages = template_messages(messages, active, parser, native)
    grammar = tools_grammar(parser, tools, choice, parallel) if choice else None
    return ToolSetup(
        parser if choice else None, messages, active if native else [], grammar,
        choice not in (None, "auto"),
    )  # fmt: skip


def tools_grammar(
    parser: str, tools: list[dict[str, Any]], choice: str | None, parallel: bool
) -> Grammar | None:
    """The structural tag that constrains calls; `choice`: auto, required, or a tool name."""
    fmt = FORMATS[parser]

    def tag(function: dict[str, Any]) -> dict[str, Any]:
        schema = function.get("parameters") or {"type": "object"}
        begin = fmt.begin.format(name=json.dumps(function["name"]))
        # At most one space between JSON tokens: compact, so a small model cannot pad.
        content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
        return {"type": "tag", "begin": begin, "content": content, "end": fmt.end}

    functions = [t["function"] for t in tools]
    if choice not in ("auto", "required"):
        named = next(f for f in functions if f["name"] == choice)
        return Grammar("structural_tag", json.dumps({"type": "structural_tag",
                                                     "format": tag(named)}))  # fmt: skip
    tags: dict[str, Any] = {"tags": [tag(f) for f in functions], "stop_after_first": not parallel}
    if choice == "required":  # calls only, at least one
        tags.update(type="tags_with_separator", separator=fmt.separator, at_least_one=True)
    else:  # free text until the trigger
        tags.update(type="triggered_tags", triggers=[fmt.trigger], at_least_one=False)
    return Grammar("structural_tag", json.dumps({"type": "structural_tag", "format": tags}))


def check_tool_choice(tools: list[dict[str, Any]], choice: Any) -> str | None:
    """`tool_choice` as none / auto / required / a tool's name; None when tools are off."""
    if choice is None:
        return "auto" if tools else None
    if not tools:
        if choice == "none":
            return None
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice in ("none", "auto", "required"):
        return None if choice == "none" else str(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise BadRequest(
            "tool_choice must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise BadRequest(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return name


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: str, native: bool
) -> list[dict[str, Any]]:
    """The history as the template should see it: a template without tools (`native`
    False) gets a system message teaching the format, and earlier calls as text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls and native:
            message["tool_calls"] = [_template_call(c) for c in calls]
        elif calls:
            written = "\n".join(_written_call(parser, c) for c in calls)
            message["content"] = "\n".join(x for x in (message["content"], written) if x)
        out.append(message)
    if tools and not native:
        signatures = "\n".join(json.dumps(t) for t in tools)
        teach = FORMATS[parser].teach.format(tools=signatures)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{teach}"}
        else:
            out.insert(0, {"role": "system", "content": teach})
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, ValueError):
        pass
    return {**call, "function": function}


def _written_call(parser: str, call: dict[str, Any]) -> str:
    fmt, function = FORMATS[parser], call["function"]
    begin = fmt.begin.format(name=json.dumps(function["name"]))
    return f"{begin}{function['arguments'] or '{}'}{fmt.end}"


def parse_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls or None, the calls) of a finished output."""
    outside, calls = _split(parser, text)
    content = outside.strip()
    return content or None, calls


def _split(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    fmt = FORMATS[parser]
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    decoder = json.JSONDecoder()
    while (start := text.find(fmt.trigger, pos)) >= 0:
        body_at = start + len(fmt.trigger) if parser == "hermes" else start
        try:
            obj, body_end = decoder.raw_decode(text, _skip_space(text, body_at))
        except ValueError:
            break
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            break
        end = body_end
        if parser == "hermes":
            close = re.match(r"\s*</tool_call>", text[body_end:])
            end += close.end() if close else 0
        args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
        calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        kept.append(text[pos:start])
        pos = end
    kept.append(text[pos:])
    kept = kept[:1] + [k for k in kept[1:] if k.strip(" \n;")]  # llama3 separates by ";"
    return "".join(kept).replace("<|python_tag|>", ""), calls


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def call_id(rid: str, index: int) -> str:
    """A stable id per call: the same after a re-render on another replica."""
    return f"call_{hashlib.sha256(rid.encode()).hexdigest()[:20]}{index}"


@dataclass
class ToolStream:
    """One streamed choice: text is shown until a call may begin; the rest waits for the
    finish, when the calls are parsed out of the whole output."""

    parser: str
    text: str = ""
    shown: int = 0
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> str:
        """The content to show now."""
        self.text += delta
        if finished:  # what was shown is a prefix of the text outside the calls
            outside, self.calls = _split(self.parser, self.text)
            rest = outside[self.shown :]
            self.shown = len(self.text)
            return rest if outside.strip() else ""
        safe = _safe_prefix(self.text, FORMATS[self.parser].trigger)
        new, self.shown = self.text[self.shown : safe], max(self.shown, safe)
        return new


def _safe_prefix(text: str, trigger: str) -> int:
    """How much of `text` is surely not part of a call: up to the trigger, or short of a
    tail that could still become it."""
    at = text.find(trigger)
    if at >= 0:
        return at
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-k:]):
            return len(text) - k
    return len(text)
