"""Tool calling on the real stack with SmolLM2: `required` and a named tool are constrained by
the tools' parameter schemas, so even this small model returns calls whose arguments validate;
streams end with the calls as a tool_calls delta; a history with calls and tool results is
taken; the official openai client reads the calls unchanged."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}  # fmt: skip
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(stack: Stack, **body: Any) -> dict[str, Any]:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **body}
    resp = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _valid(call: dict[str, Any]) -> str:
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return str(name)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_returns_calls_whose_arguments_validate(stack: Stack, temperature: float) -> None:
    body = _chat(stack, tool_choice="required", temperature=temperature, seed=3, n=2,
                 parallel_tool_calls=False)  # fmt: skip
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and _valid(calls[0]) in SCHEMAS


def test_parallel_calls_each_validate(stack: Stack) -> None:
    body = _chat(stack, tool_choice="required", max_tokens=120)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert calls and all(_valid(call) in SCHEMAS for call in calls)
    assert len({call["id"] for call in calls}) == len(calls)


def test_a_named_tool_is_the_one_called(stack: Stack) -> None:
    body = _chat(stack, tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = body["choices"][0]["message"]
    assert [_valid(call) for call in message["tool_calls"]] == ["get_time"]
    assert message["content"] is None


def test_a_streamed_call_arrives_as_a_tool_calls_delta(stack: Stack) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80,
            "temperature": 0, "stream": True, "parallel_tool_calls": False}  # fmt: skip
    calls: list[dict[str, Any]] = []
    finish = None
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body,
                      timeout=120) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["index"] == 0
    _valid(calls[0])


def test_a_history_with_calls_and_results_is_taken(stack: Stack) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    body = _chat(stack, messages=history, tool_choice="auto", max_tokens=24)
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_the_openai_client_reads_the_calls(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    done = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        temperature=0, max_tokens=80,
    )  # fmt: skip
    call = done.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name in SCHEMAS  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore[union-attr]
