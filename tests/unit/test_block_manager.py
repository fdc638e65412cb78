"""Paged KV block accounting and prefix caching (pure Python)."""

from __future__ import annotations

from shared.protocol import LogprobRequest, SamplingParams
from workers.scheduler.core.block_manager import BlockManager
from workers.scheduler.core.logprob_state import LogprobState
from workers.scheduler.core.sequence import Sequence


def make_seq(num_tokens: int, rid: str = "r", first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + num_tokens)), SamplingParams())


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """`seq` after a prefill of its first `num_tokens` tokens (default: all but the last)."""
    num_tokens = len(seq) - 1 if num_tokens is None else num_tokens
    bm.allocate_cached_prefix(seq)
    bm.allocate(seq, num_tokens)
    before, seq.num_computed_tokens = seq.num_computed_tokens, num_tokens
    bm.cache_blocks(seq, before)
    return seq


def refs(bm: BlockManager, seq: Sequence) -> list[int]:
    return [bm.blocks[b].ref_count for b in seq.block_table]


# -- plain paging ----------------------------------------------------------------------------


def test_allocate_takes_just_enough_blocks_and_deallocate_returns_them() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(9, "a"), make_seq(4, "b", first=50)
    bm.allocate(a, len(a))
    bm.allocate(b, len(b))
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_free_blocks == 6
    assert len(set(a.block_table) | set(b.block_table)) == 4  # no block is shared
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 9
    bm.deallocate(b)
    assert bm.num_free_blocks == bm.num_total_blocks == 10


def test_can_allocate_refuses_more_than_is_free() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(13)
    assert bm.can_allocate(seq, 12)
    assert not bm.can_allocate(seq, 13)
    bm.allocate(seq, 8)  # a first chunk: 2 blocks, 1 free; growing to 12 needs just that one
    assert bm.can_allocate(seq, 12) and not bm.can_allocate(seq, 13)


def test_allocate_grows_a_sequence_only_when_its_last_token_starts_a_block() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(4)
    bm.allocate(seq, len(seq))
    assert bm.num_free_blocks == 2
    seq.append_token(7)  # token 5 starts block 2
    bm.allocate(seq, len(seq))
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    for _ in range(3):  # tokens 6..8 fit in block 2
        seq.append_token(7)
        bm.allocate(seq, len(seq))
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1


# -- prefix caching --------------------------------------------------------------------------


def test_a_shared_prefix_reuses_the_computed_full_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = computed(bm, make_seq(10, "a"))  # blocks [1-4] [5-8] [9 10]
    b = Sequence("b", [*range(1, 9), 77, 78, 79], SamplingParams())  # same first 8 tokens
    bm.allocate_cached_prefix(b)
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    assert refs(bm, a) == [2, 2, 1]
    bm.allocate(b, len(b))
    assert b.block_table[2] not in a.block_table  # the rest is its own
    bm.deallocate(a)
    assert refs(bm, b) == [1, 1, 1]


def test_block_hashes_chain_so_an_equal_block_after_a_different_prefix_misses() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    computed(bm, make_seq(9, "a"))
    b = Sequence("b", [0, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())  # block 2 equal, 1 not
    bm.allocate_cached_prefix(b)
    assert b.block_table == [] and b.num_computed_tokens == 0


def test_the_last_token_is_never_taken_from_the_cache() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = computed(bm, make_seq(9, "a"), 8)
    same = make_seq(8, "same")  # two full blocks, both cached: only the first is reused
    bm.allocate_cached_prefix(same)
    assert same.block_table == a.block_table[:1] and same.num_computed_tokens == 4


def test_only_full_computed_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    computed(bm, make_seq(20, "a"), 6)  # blocks allocated for 6 tokens, 1 full
    b = make_seq(20, "b")
    bm.allocate_cached_prefix(b)
    assert b.num_computed_tokens == 4


def test_freed_cached_blocks_stay_reusable_until_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = computed(bm, make_seq(9, "a"), 8)  # 2 cached blocks
    c = computed(bm, make_seq(9, "c", first=40), 8)  # 2 more
    a_blocks, c_blocks = list(a.block_table), list(c.block_table)
    bm.deallocate(a)
    bm.deallocate(c)
    assert bm.num_free_blocks == 6  # cached blocks count as free
    # 2 never-used blocks go first, then a's (freed before c's), tail block before head.
    x = make_seq(12, "x", first=80)
    bm.allocate(x, len(x))
    assert x.block_table[2] == a_blocks[1]
    again = make_seq(9, "again")
    bm.allocate_cached_prefix(again)  # a's head block is still cached, its tail is gone
    assert again.block_table == a_blocks[:1]
    c_again = make_seq(9, "c2", first=40)
    bm.allocate_cached_prefix(c_again)
    assert c_again.block_table == c_blocks


def test_an_evicted_block_is_forgotten() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = computed(bm, make_seq(5, "a"), 4)
    bm.deallocate(a)
    x = make_seq(8, "x", first=50)
    bm.allocate(x, 8)  # needs both blocks: evicts a's
    assert not bm.cached
    bm.deallocate(x)
    again = make_seq(5, "again")
    bm.allocate_cached_prefix(again)
    assert again.block_table == []


def test_twins_computed_together_keep_one_cached_copy() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(5, "a"), make_seq(5, "b")
    for seq in (a, b):  # both allocated before either is computed: no sharing
        bm.allocate_cached_prefix(seq)
        bm.allocate(seq, len(seq))
    for seq in (a, b):
        seq.num_computed_tokens = 4
        bm.cache_blocks(seq, 0)
    assert bm.cached == {a.block_hashes[0]: a.block_table[0]}
    assert bm.blocks[b.block_table[0]].hash is None
    b_head = b.block_table[0]
    bm.deallocate(b)  # b's uncached copy is handed out first
    assert next(iter(bm.free)) == b_head
    third = make_seq(5, "third")
    bm.allocate_cached_prefix(third)
    assert third.block_table == a.block_table[:1]


def test_disabled_prefix_caching_never_shares() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    computed(bm, make_seq(9, "a"))
    b = make_seq(9, "b")
    bm.allocate_cached_prefix(b)
    assert b.block_table == [] and not bm.cached


def test_prompt_positions_whose_logprobs_were_asked_for_are_computed_not_cached() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    computed(bm, make_seq(13, "a"), 12)  # 3 cached blocks
    for start_len, num_cached in [(-1, 12), (13, 12), (9, 8), (5, 4), (4, 0), (0, 0)]:
        seq = make_seq(13, f"lp{start_len}")
        seq.logprobs = LogprobState(LogprobRequest(start_len=start_len), 13)
        bm.allocate_cached_prefix(seq)
        assert seq.num_computed_tokens == num_cached, start_len
        bm.deallocate(seq)
