"""OpenAI's Responses API on the real stack, through the official openai client: text,
a JSON schema through text.format, function tools, streaming events, and the stateless
refusal of previous_response_id."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"]}  # fmt: skip
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER}  # fmt: skip


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def test_text_in_text_out(stack: Stack) -> None:
    resp = _client(stack).responses.create(
        model="default", input="What is the capital of France?", instructions="Be brief.",
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens > 0


class Answer(BaseModel):
    city: str = Field(max_length=20)
    confidence: Literal["low", "high"]


def test_parse_with_a_pydantic_text_format(stack: Stack) -> None:
    resp = _client(stack).responses.parse(
        model="default", input="Which city is the capital of France?", text_format=Answer,
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    assert isinstance(resp.output_parsed, Answer)


def test_a_required_function_call_and_its_result_in_the_next_turn(stack: Stack) -> None:
    client = _client(stack)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="default", input=ask, tools=[TOOL],  # type: ignore[arg-type,list-item]
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(
        model="default", tools=[TOOL], temperature=0, max_output_tokens=24,  # type: ignore[list-item]
        input=[*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 21}'}],  # type: ignore[list-item]
    )  # fmt: skip
    assert second.status in ("completed", "incomplete")


def test_streaming_events(stack: Stack) -> None:
    stream = _client(stack).responses.create(
        model="default", input="Say hello.", temperature=0, max_output_tokens=16, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_previous_response_id_is_refused(stack: Stack) -> None:
    resp = httpx.post(stack.base_url + "/v1/responses", timeout=30,
                      json={"input": "hi", "previous_response_id": "resp_1"})  # fmt: skip
    assert resp.status_code == 400 and "previous_response_id" in resp.json()["error"]["message"]


def test_a_streamed_function_call(stack: Stack) -> None:
    stream = _client(stack).responses.create(
        model="default", input="What is the weather in Oslo?", tools=[TOOL],  # type: ignore[list-item]
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=60,
        stream=True,
    )  # fmt: skip
    events = list(stream)
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    jsonschema.validate(json.loads(done.arguments), WEATHER)  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["function_call"]
