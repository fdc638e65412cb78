"""DecodeState / DetokenizerCore with the real SmolLM2 tokenizer: UTF-8, stop strings, fencing."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from shared.protocol import DetokParams, FinishReason, TextEntry, TokenBatch
from tests.support.detok_core import API, LENGTH, add, encode, entry, joined, stream
from workers.detokenizer.core import (
    REPLACEMENT,
    DetokenizerCore,
    Fetched,
    Needs,
    Tokenizer,
    find_first_stop,
    partial_stop_len,
)

TEXTS = [
    "Hello, world! How are you doing today?",
    "🙂 hi 日本語 ok",
    "Crème brûlée, naïve café — Ωmega 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 done.",
    "def f(x):\n\treturn x ** 2  # squares\n\n\nprint(f(3))",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


# -- incremental decoding --------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    out = stream(DetokenizerCore(tokenizer), ids)
    assert joined(out) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT not in e.text for e in out)
    assert [e.seq for e in out] == list(range(len(ids)))
    assert [e.completion_tokens for e in out] == list(range(1, len(ids) + 1))
    assert [t for e in out for t in e.token_ids] == ids
    assert out[-1].finish == LENGTH and all(e.finish is None for e in out[:-1])


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_match_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    rng = random.Random(len(text))
    chunks: list[int] = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
    out = stream(DetokenizerCore(tokenizer), ids, chunks=chunks)
    assert joined(out) == text
    assert all(REPLACEMENT not in e.text for e in out)


@pytest.mark.parametrize("char", ["🙂", "日", "語", "𝔘"])
def test_character_split_across_tokens_is_held_back(tokenizer: Tokenizer, char: str) -> None:
    ids = encode(tokenizer, "a" + char)
    # The case under test really splits one character over several byte-level tokens.
    assert len(ids) >= 3 and REPLACEMENT in tokenizer.decode(ids[:2])
    out = stream(DetokenizerCore(tokenizer), ids)
    assert [e.text for e in out][0] == "a"
    assert [e.text for e in out][1:-1] == [""] * (len(ids) - 2)
    assert out[-1].text == char


def test_finish_flushes_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "ok🙂")[:-1]  # the emoji's last byte never comes
    out = stream(DetokenizerCore(tokenizer), ids)
    assert REPLACEMENT not in "".join(e.text for e in out[:-1])
    assert joined(out) == tokenizer.decode(ids) and joined(out).endswith(REPLACEMENT)


# -- special tokens --------------------------------------------------------------------------
def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "<|im_start|>assistant\nHi there<|im_end|>\nmore")
    assert 1 in ids and 2 in ids  # both special tokens are single ids
    skipped = stream(DetokenizerCore(tokenizer), ids)
    assert joined(skipped) == "assistant\nHi there\nmore"
    kept = stream(
        DetokenizerCore(tokenizer), ids, params=DetokParams(api_id=API, skip_special_tokens=False)
    )
    assert joined(kept) == "<|im_start|>assistant\nHi there<|im_end|>\nmore"


@pytest.mark.parametrize(("no_stop_trim", "tail"), [(False, ""), (True, "<|im_end|>")])
def test_matched_stop_token_is_trimmed(tokenizer: Tokenizer, no_stop_trim: bool, tail: str) -> None:
    ids = encode(tokenizer, "Hi there") + [2]
    params = DetokParams(api_id=API, skip_special_tokens=False, no_stop_trim=no_stop_trim)
    out = stream(
        DetokenizerCore(tokenizer), ids, params=params, finish=FinishReason("stop", matched=2)
    )
    assert joined(out) == "Hi there" + tail
    assert out[-1].token_ids == [2] and out[-1].completion_tokens == len(ids)


# -- stop strings ----------------------------------------------------------------------------
STOP_TEXT = "The answer is 42.\nEND of story, then more text"


def _assert_never_leaks(out: list[TextEntry], stop: str) -> None:
    so_far = ""
    for e in out:
        so_far += e.text
        assert stop not in so_far


@pytest.mark.parametrize("scheduler_noticed", [True, False])
def test_stop_string_is_trimmed_and_never_streamed(
    tokenizer: Tokenizer, scheduler_noticed: bool
) -> None:
    ids = encode(tokenizer, STOP_TEXT)
    params = DetokParams(api_id=API, stop=["\nEND"])
    if scheduler_noticed:
        # Finish on the token that completes the stop string.
        n = next(i for i in range(len(ids)) if "\nEND" in tokenizer.decode(ids[: i + 1]))
        ids, finish = ids[: n + 1], FinishReason("stop", matched="\nEND")
    else:
        finish = LENGTH
    out = stream(DetokenizerCore(tokenizer), ids, params=params, finish=finish)
    _assert_never_leaks(out, "\nEND")
    assert joined(out) == "The answer is 42."
    assert out[-1].finish == finish and out[-1].completion_tokens == len(ids)


def test_stop_string_prefixes_are_held_then_released(tokenizer: Tokenizer) -> None:
    text = "Say END now. The ENDING. Then END. tail"
    ids = encode(tokenizer, text)
    out = stream(DetokenizerCore(tokenizer), ids, params=DetokParams(api_id=API, stop=["END."]))
    _assert_never_leaks(out, "END.")
    assert joined(out) == "Say END now. The ENDING. Then "


def test_partial_stop_prefix_released_when_text_diverges(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "abc STO xyz")
    core = DetokenizerCore(tokenizer)
    out = stream(core, ids, params=DetokParams(api_id=API, stop=["STOP"]), finish=None)
    assert joined(out) == "abc STO xyz"  # nothing held once "STO" was followed by " x"
    held = stream(core, encode(tokenizer, "abc ST"), rid="r2", finish=None,
                  params=DetokParams(api_id=API, stop=["STOP"]))  # fmt: skip
    assert joined(held) == "abc "


def test_no_stop_trim_keeps_the_stop_string(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, STOP_TEXT)
    params = DetokParams(api_id=API, stop=["\nEND"], no_stop_trim=True)
    out = stream(DetokenizerCore(tokenizer), ids, params=params)
    assert joined(out) == "The answer is 42.\nEND"


def test_matched_stop_string_not_in_params_is_trimmed(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "one two three")
    out = stream(DetokenizerCore(tokenizer), ids, finish=FinishReason("stop", matched=" three"))
    assert joined(out) == "one two"


def test_stop_helpers() -> None:
    assert find_first_stop("xxabcab", ["ab", "ca"]) == (2, "ab")
    assert find_first_stop("xxabcab", ["ab"], start=3) == (5, "ab")
    assert find_first_stop("xyz", ["ab"]) is None
    assert partial_stop_len("hello wor", ["world", "or"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("w", ["world"]) == 1


# -- fencing and state lifecycle ------------------------------------------------------------
def _ids(tokenizer: Tokenizer) -> list[int]:
    return encode(tokenizer, "one two three four five")


def test_duplicate_and_overlapping_entries(tokenizer: Tokenizer) -> None:
    ids, core, p = _ids(tokenizer), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    first = add(core, entry("r", 0, ids[:2], params=p))[API]
    assert add(core, entry("r", 0, ids[:2], params=p)) == {}  # duplicate
    assert add(core, entry("r", 1, ids[1:2])) == {}  # duplicate of the second token
    overlap = add(core, entry("r", 1, ids[1:4]))[API]  # one old token, two new
    assert overlap[0].seq == 2 and overlap[0].token_ids == ids[2:4]
    assert joined(first + overlap) == tokenizer.decode(ids[:4])


def test_stale_epoch_dropped_and_higher_epoch_continues(tokenizer: Tokenizer) -> None:
    ids, core, p = _ids(tokenizer), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    first = add(core, entry("r", 0, ids[:2], epoch=1, params=p))[API]
    assert add(core, entry("r", 2, ids[2:3], epoch=0)) == {}
    state = core.get("r")
    assert state is not None and state.next_seq == 2
    resumed = add(core, entry("r", 2, ids[2:4], epoch=2, params=p))[API]
    assert resumed[0].epoch == 2 and resumed[0].seq == 2
    assert joined(first + resumed) == tokenizer.decode(ids[:4])
    assert add(core, entry("r", 4, ids[4:5], epoch=1)) == {}  # old owner woke up
    state = core.get("r")
    assert state is not None and state.epoch == 2 and state.next_seq == 4


def test_gap_is_logged_and_decoding_goes_on(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    ids, core, p = _ids(tokenizer), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    add(core, entry("r", 0, ids[:1], params=p))
    with caplog.at_level(logging.WARNING):
        out = add(core, entry("r", 3, ids[3:4]))[API]
    assert "rid=r gap" in caplog.text
    assert out[0].seq == 3 and out[0].completion_tokens == 4 and out[0].text


def test_state_removed_on_finish_and_late_entries_dropped(tokenizer: Tokenizer) -> None:
    ids, core = _ids(tokenizer), DetokenizerCore(tokenizer)
    stream(core, ids)
    assert "r" not in core and len(core) == 0
    assert add(core, entry("r", len(ids) - 1, ids[-1:], finish=LENGTH)) == {}
    # A replay of the whole request by the same owner (it carries params) is dropped too.
    assert add(core, entry("r", 0, ids, finish=LENGTH, params=DetokParams(api_id=API))) == {}
    assert not core.needs(TokenBatch("w", [entry("r", 0, ids)]))


def test_cap_evicts_least_recently_used(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    core, p = DetokenizerCore(tokenizer, max_states=2), DetokParams(api_id=API)
    add(core, entry("a", 0, [28], params=p), entry("b", 0, [28], params=p))
    add(core, entry("a", 1, [28]))  # a is now more recent than b
    with caplog.at_level(logging.WARNING):
        add(core, entry("c", 0, [28], params=p))
    assert len(core) == 2 and "a" in core and "c" in core and "b" not in core
    assert "rid=b evicted" in caplog.text


def test_unknown_rid_needs_its_state_and_uses_its_api_id(tokenizer: Tokenizer) -> None:
    ids, core = _ids(tokenizer), DetokenizerCore(tokenizer)
    batch = TokenBatch("w", [entry("x", 0, ids[:2])])
    assert core.needs(batch) == Needs(states=["x"])
    assert core.add_batch(batch) == {}
    out = core.add_batch(batch, Fetched(api_ids={"x": "api-9"}))
    assert out["api-9"][0].text == tokenizer.decode(ids[:2]) and out["api-9"][0].seq == 0


def test_routes_by_api_id(tokenizer: Tokenizer) -> None:
    core = DetokenizerCore(tokenizer)
    out = add(
        core,
        entry("a", 0, [28], params=DetokParams(api_id="api-1")),
        entry("b", 0, [28], params=DetokParams(api_id="api-2")),
        entry("c", 0, [28], params=DetokParams(api_id="api-1")),
    )
    assert {k: [e.rid for e in v] for k, v in out.items()} == {"api-1": ["a", "c"], "api-2": ["b"]}


def test_abort_drops_state_and_forwards_only_the_finish(tokenizer: Tokenizer) -> None:
    ids, core, p = _ids(tokenizer), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    add(core, entry("r", 0, ids[:2], params=p))
    core.abort(["r", "never-seen"])
    assert "r" not in core and len(core) == 0
    assert add(core, entry("r", 2, ids[2:3])) == {}
    aborted = FinishReason("abort", message="aborted")
    out = add(core, entry("r", 3, ids[3:4], finish=aborted))[API]
    assert out[0].finish == aborted and out[0].text == ""
    assert add(core, entry("r", 3, ids[3:4], finish=aborted)) == {}


def test_bad_token_fails_that_request_only(tokenizer: Tokenizer) -> None:
    core, p = DetokenizerCore(tokenizer), DetokParams(api_id=API)
    out = add(core, entry("bad", 0, [-1], params=p), entry("good", 0, [28], params=p))[API]
    bad, good = out
    assert bad.finish is not None and bad.finish.type == "abort" and bad.finish.status_code == 500
    assert good.finish is None and good.text == tokenizer.decode([28])
    assert "bad" not in core and "good" in core
