"""Paged KV block accounting (pure Python)."""

from __future__ import annotations

from shared.protocol import SamplingParams
from workers.scheduler.block_manager import BlockManager
from workers.scheduler.sequence import Sequence


def make_seq(num_tokens: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(1, num_tokens + 1)), SamplingParams())


def test_allocate_takes_just_enough_blocks_and_deallocate_returns_them() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(9, "a"), make_seq(4, "b")
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_free_blocks == 6
    assert len(set(a.block_table) | set(b.block_table)) == 4  # no block is shared
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 9
    bm.deallocate(b)
    assert bm.num_free_blocks == bm.num_total_blocks == 10


def test_can_allocate_refuses_more_than_is_free() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.can_allocate(make_seq(12))
    assert not bm.can_allocate(make_seq(13))


def test_may_append_adds_a_block_only_when_the_last_token_starts_one() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(4)
    bm.allocate(seq)
    assert bm.num_free_blocks == 2
    seq.append_token(7)  # token 5 starts block 2
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    for _ in range(3):  # tokens 6..8 fit in block 2
        seq.append_token(7)
        bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1


def test_can_append_is_false_when_no_block_is_left() -> None:
    bm = BlockManager(num_blocks=1, block_size=2)
    seq = make_seq(2)
    bm.allocate(seq)
    seq.append_token(5)
    assert not bm.can_append(seq)
