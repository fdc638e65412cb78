"""`echo` with `logprobs` on /v1/completions, as lm-evaluation-harness scores texts: the
prompt's tokens come back with their logprobs, equal to Hugging Face transformers' on the
same model (fp32), with `max_tokens` 0 (prompt only) and 1."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


@pytest.fixture(scope="module")
def hf_logprobs(model_path: str) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = list(tokenizer(TEXT)["input_ids"])
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return ids, logprobs.squeeze(1).tolist()


def _complete(stack: Stack, **body: Any) -> dict[str, Any]:
    resp = httpx.post(stack.base_url + "/v1/completions",
                      json={"model": "default", "temperature": 0, **body}, timeout=120)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["choices"][0])


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt_s_logprobs_as_transformers_computes_them(
    stack: Stack, hf_logprobs: tuple[list[int], list[float]], max_tokens: int
) -> None:
    ids, expected = hf_logprobs
    choice = _complete(stack, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1 : len(ids)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-3
    assert choice["text"].startswith(TEXT)
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                                 strict=True):  # fmt: skip
        assert top[token] == value and len(top) in (1, 2)  # the token, and the top-1 if other


def test_echo_of_a_text_prompt_and_suffix_is_refused(stack: Stack) -> None:
    choice = _complete(stack, prompt=TEXT, echo=True, max_tokens=2)
    assert choice["text"].startswith(TEXT) and len(choice["text"]) > len(TEXT)
    resp = httpx.post(stack.base_url + "/v1/completions",
                      json={"prompt": "x", "suffix": "y"}, timeout=30)  # fmt: skip
    assert resp.status_code == 400 and "suffix" in resp.json()["error"]["message"]


def test_a_streamed_echo_starts_with_the_prompt(stack: Stack) -> None:
    body = {"model": "default", "prompt": TEXT, "echo": True, "max_tokens": 3, "temperature": 0,
            "stream": True, "logprobs": 1}  # fmt: skip
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=120) as resp:
        chunks = [json.loads(line[6:])["choices"][0] for line in resp.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    assert chunks[0]["text"].startswith(TEXT)
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    whole = _complete(stack, prompt=TEXT, echo=True, max_tokens=3, logprobs=1)
    assert "".join(c["text"] for c in chunks) == whole["text"]
