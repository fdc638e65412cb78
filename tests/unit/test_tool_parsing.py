"""Tool calls out of model text (hermes and llama3 parsers) and the streaming hold-back."""

from __future__ import annotations

import json

import pytest

from api.tools import ToolCall, ToolStream, parse_calls, template_messages, tools_grammar

HERMES = (
    'Let me check.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
)


def test_hermes_calls_and_the_text_around_them() -> None:
    content, calls = parse_calls("hermes", HERMES)
    assert content == "Let me check."
    assert calls == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]


def test_llama3_calls_separated_by_semicolons() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert parse_calls("llama3", text) == (None, [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")])


@pytest.mark.parametrize("text", ["plain text", "<tool_call>\n{\"name\": \"f\", \"argu", "{}"])
def test_text_without_a_whole_call_stays_content(text: str) -> None:
    assert parse_calls("hermes", text) == (text.strip(), [])


def test_a_stream_shows_text_until_a_call_may_begin() -> None:
    stream = ToolStream("hermes")
    pieces = ["Let me", " check.<tool", "_call>\n{\"name\": \"f\", ", '"arguments": {"a": 1}}',
              "\n</tool_call>"]  # fmt: skip
    shown = [stream.feed(p, False) for p in pieces] + [stream.feed("", True)]
    assert shown == ["Let me", " check.", "", "", "", ""]
    assert stream.calls == [ToolCall("f", '{"a": 1}')]


def test_a_stream_that_only_looked_like_a_call_shows_it_all() -> None:
    stream = ToolStream("hermes")
    shown = [stream.feed("a <to", False), stream.feed("o> b", False), stream.feed("", True)]
    assert "".join(shown) == "a <too> b" and not stream.calls


def test_grammars_per_choice() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    auto = json.loads(tools_grammar("hermes", tools, "auto", True).text)["format"]  # type: ignore[union-attr]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]
    named = json.loads(tools_grammar("llama3", tools, "f", True).text)["format"]  # type: ignore[union-attr]
    assert named["type"] == "tag" and named["begin"] == '{"name": "f", "parameters": '


def test_a_template_without_tools_is_taught_them_and_sees_calls_as_text() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = template_messages(messages, tools, "hermes", native=False)
    assert out[0]["content"].startswith("Be brief.\n\n") and "<tools>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    native = template_messages([dict(m) for m in messages[1:]], tools, "hermes", native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
