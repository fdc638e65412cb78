"""DetokenizerCore recovery with the real SmolLM2 tokenizer: a request rebuilt from its id log
by another detokenizer, a new owner epoch, gaps refilled, re-attaches. Each case is checked
against what one detokenizer that saw every message sends."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from transformers import AutoTokenizer

from shared.protocol import DetokParams, FinishReason, Logprobs, TextEntry, TokenBatch
from tests.support.detok_core import (
    API,
    LENGTH,
    add,
    encode,
    entry,
    fetch_from_log,
    joined,
    received,
    stream,
)
from workers.detokenizer.core import DetokenizerCore, Fetched, IdRange, Needs, Tokenizer

TEXTS = [
    "Hello 🙂 world, 日本語 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 go on.",
    "The answer is 42.\nEND of story, then more text",
]
STOP = DetokParams(api_id=API, stop=["\nEND"])


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


def feed(
    core: DetokenizerCore,
    ids: list[int],
    start: int,
    end: int,
    *,
    epoch: int = 0,
    params: DetokParams,
    log: list[int] | None = None,
) -> list[TextEntry]:
    """Entries [start, end) one id each, as the scheduler sends them; the fetches the core
    asks for are answered from `log` (the request's id log, default `ids`)."""
    out: list[TextEntry] = []
    for seq in range(start, end):
        finish = LENGTH if seq == len(ids) - 1 else None
        e = entry("r", seq, ids[seq : seq + 1], epoch=epoch, finish=finish)
        e.detok = params if seq == start else None
        batch = TokenBatch("w", [e])
        fetched = fetch_from_log(core, batch, log or ids, params.api_id)
        out.extend(core.add_batch(batch, fetched).get(params.api_id, []))
    return out


def no_fault(tokenizer: Tokenizer, ids: list[int], params: DetokParams) -> str:
    return joined(stream(DetokenizerCore(tokenizer), ids, params=params))


@pytest.mark.parametrize("params", [DetokParams(api_id=API), STOP], ids=["plain", "stop"])
@pytest.mark.parametrize("text", TEXTS)
def test_another_detokenizer_rebuilds_the_exact_text(
    tokenizer: Tokenizer, text: str, params: DetokParams
) -> None:
    """The old one served [0, k) and died; [k, m) was lost in between; the new one starts at m."""
    ids = encode(tokenizer, text)
    expected = no_fault(tokenizer, ids, params)
    for k in range(1, len(ids) - 1):
        for m in sorted({k, k + 1, k + 3}):
            old = feed(DetokenizerCore(tokenizer), ids, 0, k, params=params)
            new = feed(
                DetokenizerCore(tokenizer), ids, min(m, len(ids) - 1), len(ids), params=params
            )
            got, got_ids, finishes = received(old + new)
            assert got == expected, (k, m)
            assert got_ids == ids and finishes == 1


def test_rebuild_replays_each_id_once_in_order(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, TEXTS[0])
    out = feed(DetokenizerCore(tokenizer), ids, 5, 6, params=DetokParams(api_id=API))
    assert [e.seq for e in out] == list(range(6))
    assert [e.token_ids for e in out] == [[i] for i in ids[:6]]
    assert [e.completion_tokens for e in out] == list(range(1, 7))
    assert all(e.output_logprobs is None for e in out[:5])


def test_replay_is_capped_by_one_entry_for_the_oldest_ids(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, TEXTS[0])
    core = DetokenizerCore(tokenizer, replay_tokens=3)
    out = feed(core, ids, 8, 9, params=DetokParams(api_id=API))
    assert [(e.seq, len(e.token_ids)) for e in out] == [(0, 5), (5, 1), (6, 1), (7, 1), (8, 1)]
    assert joined(out) == joined(stream(DetokenizerCore(tokenizer), ids[:9], finish=None))


def test_rebuild_routes_to_the_api_id_of_the_request_state(tokenizer: Tokenizer) -> None:
    ids, core = encode(tokenizer, "one two three"), DetokenizerCore(tokenizer)
    batch = TokenBatch("w", [entry("r", 2, ids[2:3], params=DetokParams(api_id="api-old"))])
    assert core.needs(batch) == Needs(states=["r"], ranges=[IdRange("r", 0, 2)])
    out = core.add_batch(batch, Fetched({"r": "api-new"}, {IdRange("r", 0, 2): ids[:2]}))
    assert list(out) == ["api-new"] and joined(out["api-new"]) == tokenizer.decode(ids[:3])


def test_without_its_id_log_a_request_decodes_on_from_its_seq(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    ids, core = encode(tokenizer, "one two three"), DetokenizerCore(tokenizer)
    with caplog.at_level(logging.WARNING):
        out = add(core, entry("r", 2, ids[2:3]), fetched=Fetched({"r": API}))[API]
    assert "cannot rebuild" in caplog.text
    assert [(e.seq, e.text) for e in out] == [(2, tokenizer.decode(ids[2:3]))]


def test_a_new_owner_epoch_continues_the_text(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, TEXTS[0])
    params = DetokParams(api_id=API)
    for k in range(1, len(ids) - 1):
        core = DetokenizerCore(tokenizer)
        before = feed(core, ids, 0, k, epoch=1, params=params)
        after = feed(core, ids, k, len(ids), epoch=2, params=params)
        assert joined(before + after) == tokenizer.decode(ids), k
        assert {e.epoch for e in after} == {2}


def test_a_new_owner_after_a_lost_step_refills_it_and_fences_the_old(
    tokenizer: Tokenizer,
) -> None:
    ids, core, p = encode(tokenizer, TEXTS[0]), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    before = feed(core, ids, 0, 4, epoch=1, params=p)
    after = feed(core, ids, 6, 8, epoch=2, params=p)  # [4, 6) lost with the old owner
    assert [e.seq for e in after] == [4, 6, 7]
    assert add(core, entry("r", 8, ids[8:9], epoch=1)) == {}  # the old owner woke up
    assert joined(before + after) == joined(
        stream(DetokenizerCore(tokenizer), ids[:8], finish=None)
    )


def test_a_gap_is_refilled_from_the_id_log(tokenizer: Tokenizer) -> None:
    ids, core, p = encode(tokenizer, TEXTS[0]), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    first = add(core, entry("r", 0, ids[:2], params=p))[API]
    later = entry("r", 5, ids[5:7])
    later.output_logprobs = Logprobs([-0.5, -0.25])
    batch = TokenBatch("w", [later])
    assert core.needs(batch) == Needs(ranges=[IdRange("r", 2, 5)])
    gap, own = core.add_batch(batch, Fetched(ids={IdRange("r", 2, 5): ids[2:5]}))[API]
    assert (gap.seq, gap.token_ids, gap.output_logprobs) == (2, ids[2:5], None)
    assert (own.seq, own.token_ids, own.output_logprobs) == (5, ids[5:7], later.output_logprobs)
    assert joined([*first, gap, own]) == joined(stream(DetokenizerCore(tokenizer), ids[:7]))


def test_duplicates_need_nothing_fetched(tokenizer: Tokenizer) -> None:
    ids, core, p = encode(tokenizer, "one two"), DetokenizerCore(tokenizer), DetokParams(api_id=API)
    add(core, entry("r", 0, ids, params=p))
    assert not core.needs(TokenBatch("w", [entry("r", 0, ids), entry("r", 1, ids[1:])]))
    assert core.needs(TokenBatch("w", [entry("r", 1, ids[1:], epoch=-1)])) == Needs()


def test_reattach_moves_live_finished_and_future_requests(tokenizer: Tokenizer) -> None:
    core, p = DetokenizerCore(tokenizer), DetokParams(api_id=API)
    add(core, entry("live", 0, [28], params=p), entry("done", 0, [28], params=p, finish=LENGTH))
    core.abort(["done"])  # no-op: finished already
    add(core, entry("gone", 0, [28], params=p))
    core.abort(["gone"])
    core.reattach(["live", "gone", "later"], "api-2")
    aborted = FinishReason("abort", message="aborted")
    out = add(
        core,
        entry("live", 1, [28]),
        entry("gone", 1, [28], finish=aborted),
        entry("later", 0, [28], params=p),
    )
    assert list(out) == ["api-2"]
    assert [e.rid for e in out["api-2"]] == ["live", "gone", "later"]


def test_forget_drops_live_states_only(tokenizer: Tokenizer) -> None:
    core, p = DetokenizerCore(tokenizer), DetokParams(api_id=API)
    add(core, entry("a", 0, [28], params=p), entry("b", 0, [28], params=p))
    core.forget(["a", "never-seen"])
    assert core.rids() == ["b"]


@pytest.mark.parametrize("params", [DetokParams(api_id=API), STOP], ids=["plain", "stop"])
def test_a_resend_from_any_seq_completes_what_the_receiver_had(
    tokenizer: Tokenizer, params: DetokParams
) -> None:
    """A replica that got entries [0, k) and missed the rest asks for a resend from k."""
    ids = encode(tokenizer, TEXTS[1])
    expected = no_fault(tokenizer, ids, params)
    for k in range(len(ids) - 1):
        core = DetokenizerCore(tokenizer)
        sent = feed(core, ids, 0, len(ids) - 1, params=params)  # all but the finish
        kept = [e for e in sent if e.seq < k]
        routed = core.resend("r", k)
        assert routed is not None and routed[0] == API
        assert [e.seq for e in routed[1]] == list(range(k, len(ids) - 1))
        last = feed(core, ids, len(ids) - 1, len(ids), params=params)
        got, got_ids, finishes = received(kept + routed[1] + last)
        assert (got, got_ids, finishes) == (expected, ids, 1), k


def test_a_resend_for_a_request_not_held_here_is_nothing(tokenizer: Tokenizer) -> None:
    core = DetokenizerCore(tokenizer)
    assert core.resend("unknown", 0) is None
    feed(core, encode(tokenizer, TEXTS[0]), 0, 3, params=DetokParams(api_id=API))
    assert core.resend("r", 3) is None  # nothing past what was sent
    assert core.resend("r", -1) is None
