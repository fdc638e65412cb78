"""Structured output at the api: each API's names become one Grammar on the job, and a
constraint that does not compile is a 400 naming the problem, with nothing queued."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.protocol import Grammar
from tests.support.backend import FakeBackend

MSG = [{"role": "user", "content": "hi"}]
FMT = {"type": "json_schema", "json_schema": {"name": "x"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("path", "body", "grammar"),
    [
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(SCHEMA)}},
         Grammar("json_schema", json.dumps(SCHEMA))),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "a+"}}, Grammar("regex", "a+")),
        ("/generate", {"text": "hi", "sampling_params": {"ebnf": 'root ::= "x"'}},
         Grammar("ebnf", 'root ::= "x"')),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}},
         Grammar("json_object")),
        ("/v1/chat/completions",
         {"messages": MSG,
          "response_format": {**FMT, "json_schema": {"name": "x", "schema": SCHEMA}}},
         Grammar("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}},
         Grammar("json_object")),
        ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"]},
         Grammar("regex", "(yes)|(no)")),
        ("/v1/chat/completions", {"messages": MSG, "structured_outputs": {"regex": r"\d+"}},
         Grammar("regex", r"\d+")),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
async def test_each_api_s_names_become_the_job_s_grammar(
    client: httpx.AsyncClient, backend: FakeBackend, path: str, body: Any, grammar: Grammar | None
) -> None:
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    assert backend.jobs[-1].sampling.grammar == grammar


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": "foo"}'}},
         'Invalid json_schema: Unsupported type "foo"'),
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}},
         "Invalid json_schema"),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "[a-"}},
         "Invalid regex: Regex parsing error at position 4: Unclosed '['"),
        ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= foo"}},
         'Rule "foo" is not defined'),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
         "Only one of regex, json_schema, or ebnf can be set."),
        ("/v1/chat/completions",
         {"messages": MSG, "response_format": FMT},
         "response_format.json_schema.schema is required"),
        ("/v1/chat/completions",
         {"messages": MSG,
          "response_format": {**FMT, "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "Invalid json_schema: Type should be a string"),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "xml"}},
         "response_format"),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"},
                             "guided_regex": "a"}, "Only one of"),
        ("/v1/completions", {"prompt": "hi", "guided_grammar": "root ::= ("}, "Invalid ebnf"),
        ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "at least one choice"),
    ],
)  # fmt: skip
async def test_a_constraint_that_does_not_compile_is_a_400(
    client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys, path: str, body: Any,
    needle: str,
) -> None:
    resp = await client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert await fake_redis.xlen(keys.request_stream) == 0


TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "Invalid structural_tag"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "Tool 'g' has not been passed in `tools`."),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice must be"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
    ],
)  # fmt: skip
async def test_bad_tools_are_a_400(
    client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys, body: Any, needle: str
) -> None:
    resp = await client.post("/v1/chat/completions", json={"messages": MSG, **body})
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert await fake_redis.xlen(keys.request_stream) == 0


async def test_tools_constrain_the_job_and_teach_a_template_without_tools(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "messages": MSG, "tools": [TOOL], "tool_choice": "required"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    job = backend.jobs[-1]
    assert job.sampling.grammar is not None and job.sampling.grammar.kind == "structural_tag"
    tag = json.loads(job.sampling.grammar.text)["format"]
    assert tag["type"] == "tags_with_separator" and tag["at_least_one"]
    assert tag["tags"][0]["content"]["json_schema"] == SCHEMA
    prompt = tokenizer.decode(job.input_ids)
    assert "<tools>" in prompt and '"name": "f"' in prompt and "<tool_call>" in prompt
    # The answer is not a call: it stays content, with finish_reason stop.
    message = resp.json()["choices"][0]
    assert message["message"]["content"] and message["finish_reason"] != "tool_calls"


async def test_sglang_s_structural_tag_in_response_format_is_taken(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    fmt = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=f>", "schema": SCHEMA, "end": "</function>"}]}
    resp = await client.post("/v1/chat/completions", json={"messages": MSG, "response_format": fmt})
    assert resp.status_code == 200, resp.text
    grammar = backend.jobs[-1].sampling.grammar
    assert grammar is not None and grammar.kind == "structural_tag"
    assert json.loads(grammar.text)["structures"][0]["schema"] == SCHEMA
