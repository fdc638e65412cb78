"""Every input form (SGLang's InputFormat and friends) returns SGLang's output shape: a single
string, a batch of strings, input_ids single or batch, parallel sampling (n > 1), chat
messages, and cross-encoder pairs, which tokenize exactly as the tokenizer called directly."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.backend import FakeBackend

META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}
PAIRS = [
    ["What is the capital of France?", "Paris is the capital of France."],
    ["How tall is Everest?", "It is about 8849 metres tall."],
]


def assert_sglang_output(out: Any) -> None:
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and isinstance(out["output_ids"], list)
    assert set(out["meta_info"]) == META


def sampling(n: int = 1, max_new: int = 3, **kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "n": n, **kw}


async def test_single_string(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    out = await client.post("/generate", json={"text": "Hello", "sampling_params": sampling()})
    assert out.status_code == 200
    assert_sglang_output(out.json())
    assert backend.jobs[0].input_ids == tokenizer.encode("Hello")


async def test_batch_of_strings(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    texts = ["Hello", "Tell me a story", "Hello"]
    resp = await client.post("/generate", json={"text": texts, "sampling_params": sampling()})
    outs = resp.json()
    assert isinstance(outs, list) and len(outs) == 3
    for out in outs:
        assert_sglang_output(out)
    by_rid = {job.rid: job.input_ids for job in backend.jobs}
    expected = tokenizer(texts)["input_ids"]
    assert [by_rid[o["meta_info"]["id"]] for o in outs] == expected


@pytest.mark.parametrize(("ids", "single"), [([5, 6, 7], True), ([[5, 6], [7], [8, 9, 10]], False)])
async def test_input_ids(
    client: httpx.AsyncClient, backend: FakeBackend, ids: Any, single: bool
) -> None:
    resp = await client.post("/generate", json={"input_ids": ids, "sampling_params": sampling()})
    out = resp.json()
    if single:
        assert_sglang_output(out)
        assert backend.jobs[0].input_ids == ids
    else:
        assert [len(o["output_ids"]) for o in out] == [3, 3, 3]
        for o in out:
            assert_sglang_output(o)
        assert sorted(j.input_ids for j in backend.jobs) == sorted(ids)


async def test_parallel_sampling_single_prompt(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    body = {"text": "Hi", "rid": "par", "sampling_params": sampling(n=3, seed=7)}
    outs = (await client.post("/generate", json=body)).json()
    assert isinstance(outs, list)  # n > 1 makes it a batch (SGLang)
    assert [o["meta_info"]["id"] for o in outs] == ["par_0", "par_1", "par_2"]
    for out in outs:
        assert_sglang_output(out)
    jobs = {j.rid: j for j in backend.jobs}
    assert len({tuple(j.input_ids) for j in jobs.values()}) == 1
    assert [jobs[f"par_{i}"].sampling.seed for i in range(3)] == [7, 8, 9]


async def test_parallel_sampling_batch_is_prompt_major(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    body = {"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": sampling(n=2)}
    outs = (await client.post("/generate", json=body)).json()
    assert [o["meta_info"]["id"] for o in outs] == ["x_0", "x_1", "y_0", "y_1"]
    resp = await client.post(
        "/generate", json={**body, "rid": None, "sampling_params": [sampling(2), sampling(3)]}
    )
    assert resp.status_code == 400
    assert "parallel_sample_num should be the same" in resp.json()["error"]["message"]


async def test_openai_n_and_batches(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    body = {"prompt": ["one", "two words"], "n": 2, "max_tokens": 3}
    out = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    prompt_tokens = len(tokenizer.encode("one")) + len(tokenizer.encode("two words"))
    assert out["usage"]["prompt_tokens"] == prompt_tokens  # each prompt counted once
    assert out["usage"]["completion_tokens"] == 12
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}
    out = (await client.post("/v1/chat/completions", json=chat)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" for c in out["choices"])


async def test_chat_messages_through_the_template(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    resp = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert resp.status_code == 200
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert backend.jobs[0].input_ids == expected


async def test_cross_encoder_pairs(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    direct = [tokenizer(q, d, return_token_type_ids=True) for q, d in PAIRS]
    tokenized = (await client.post("/tokenize", json={"prompt": PAIRS})).json()
    assert tokenized["tokens"] == [d["input_ids"] for d in direct]
    assert tokenized["token_type_ids"] == [d["token_type_ids"] for d in direct]
    assert any(1 in d["token_type_ids"] for d in direct)  # the document part is marked
    outs = (await client.post("/encode", json={"text": PAIRS, "rid": "ce"})).json()
    assert [o["meta_info"]["id"] for o in outs] == ["ce_0", "ce_1"]
    assert all(set(o) == {"embedding", "meta_info"} for o in outs)
    jobs = {j.rid: j for j in backend.jobs}
    assert [jobs[f"ce_{i}"].input_ids for i in range(2)] == [d["input_ids"] for d in direct]
    assert all(j.embed and j.sampling.max_new_tokens == 0 for j in jobs.values())


async def test_cross_encoder_pair_keeps_token_type_ids(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any, app: Any
) -> None:
    from api.req_state import GenerateReq
    from shared import protocol

    manager = app.state.manager
    reqs = [
        GenerateReq(
            rid=f"p{i}",
            prompt=(q, d),
            sampling=protocol.SamplingParams(),
            max_new_tokens=0,
            embed=True,
        )
        for i, (q, d) in enumerate(PAIRS)
    ]
    await manager._tokenize(reqs)
    for req, (q, d) in zip(reqs, PAIRS, strict=True):
        direct = tokenizer(q, d, return_token_type_ids=True)
        assert req.input_ids == direct["input_ids"]
        assert req.token_type_ids == direct["token_type_ids"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": "a", "input_ids": [1]}, "Only one of text or input_ids should be provided."),
        ({}, "Either text, input_ids or input_embeds should be provided."),
        (
            {"text": ["a", "b"], "sampling_params": [{}]},
            "The length of sampling_params should be equal to the batch size.",
        ),
        (
            {"text": ["a", "b"], "return_logprob": [True]},
            "The length of return_logprob should be equal to the batch size.",
        ),
    ],
)
async def test_sglang_input_messages(
    client: httpx.AsyncClient, body: dict[str, Any], message: str
) -> None:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": message}}
