"""Structured output on the real stack (api, scheduler, detokenizer processes, SmolLM2): every
JSON answer under a schema validates against it (jsonschema), greedy and sampled, n > 1,
streaming and not; regex and EBNF likewise; an unconstrained neighbour in the same batch
answers as it does alone; the official openai client's `parse` works unchanged."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]},
                       "mood": {"type": "string", "enum": ["happy", "sad"]}},
        "required": ["colour", "mood"],
    },
    "array": {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "minItems": 1, "maxItems": 3}},
        "required": ["fruits"],
    },
    "bounded": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "ok": {"type": "boolean"}},
        "required": ["age", "score", "ok"],
    },
}  # fmt: skip
PROMPT = "Answer in JSON: describe something."


def _chat(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 80, **body}
    resp = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_validates_greedy_and_sampled_with_n(stack: Stack, name: str) -> None:
    schema = SCHEMAS[name]
    greedy = _chat(stack, {"temperature": 0, "response_format": _fmt(schema)})
    sampled = _chat(stack, {"temperature": 1.0, "seed": 5, "n": 3, "response_format": _fmt(schema)})
    choices = greedy["choices"] + sampled["choices"]
    assert len(choices) == 4
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_streamed_answers_validate(stack: Stack) -> None:
    schema = SCHEMAS["nested"]
    body = {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 80, "stream": True,
        "n": 2, "temperature": 0.8, "seed": 1, "response_format": _fmt(schema),
    }  # fmt: skip
    texts = ["", ""]
    finishes: list[str] = []
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body,
                      timeout=120) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
                if choice["finish_reason"]:
                    finishes.append(choice["finish_reason"])
    assert finishes == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_a_free_request_is_unchanged_by_constrained_neighbours(stack: Stack) -> None:
    free = {"temperature": 0, "max_new_tokens": 24}
    prompts = ["The capital of France is", "My favourite colour is", "List three fruits:"]
    alone = httpx.post(stack.base_url + "/generate",
                       json={"text": prompts[0], "sampling_params": free}, timeout=120).json()
    batch = httpx.post(
        stack.base_url + "/generate",
        json={"text": prompts, "sampling_params": [
            free,
            {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(SCHEMAS["enum"])},
            {"temperature": 0.7, "max_new_tokens": 40, "regex": "(apple|pear|fig), (kiwi|lime)"},
        ]},
        timeout=120,
    ).json()  # fmt: skip
    assert batch[0]["text"] == alone["text"]
    jsonschema.validate(json.loads(batch[1]["text"]), SCHEMAS["enum"])
    assert re.fullmatch("(apple|pear|fig), (kiwi|lime)", batch[2]["text"])


def test_native_regex_and_ebnf(stack: Stack) -> None:
    ebnf = 'root ::= "Answer: " ("yes" | "no") "."'
    for params, pattern in [
        ({"regex": r"[A-Z][a-z]{2,8} is [0-9]{1,3} years old\."},
         r"[A-Z][a-z]{2,8} is \d+ years old\."),
        ({"ebnf": ebnf}, r"Answer: (yes|no)\."),
    ]:  # fmt: skip
        body = {"text": "Tell me about someone.", "stream": True,
                "sampling_params": {"temperature": 0.9, "seed": 2, "max_new_tokens": 30, **params}}
        with httpx.stream("POST", stack.base_url + "/generate", json=body, timeout=120) as resp:
            events = [json.loads(x[6:]) for x in resp.iter_lines()
                      if x.startswith("data: ") and x != "data: [DONE]"]  # fmt: skip
        final = events[-1]
        assert re.fullmatch(pattern, final["text"]), final["text"]
        assert final["meta_info"]["finish_reason"]["type"] == "stop"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


def test_the_openai_client_parse_returns_the_pydantic_model(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    done = client.chat.completions.parse(
        model="default", temperature=0, max_tokens=60, response_format=Pet,
        messages=[{"role": "user", "content": "Describe a pet."}],
    )  # fmt: skip
    pet = done.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.species in ("cat", "dog", "bird")
