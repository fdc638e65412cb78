"""Paged KV cache accounting with prefix caching (pure Python, nano-vllm's shape).

The model runner writes token i of a sequence into slot
`block_table[i // block_size] * block_size + i % block_size` of the cache.

Prefix caching: once a full block's K/V is computed, the block is registered under a hash
chained from the previous block's hash and its own token ids, so one hash names the whole
prefix up to the end of that block. A sequence without blocks starts from the longest run of
its leading full blocks found in the cache (shared: their ref counts go up) and computes only
the rest — always at least its last token, whose logits the step needs, and every prompt
position whose logprob was asked for. A block whose ref
count drops to 0 goes back to the free list but keeps its hash, so a later prompt can still
reuse it; it is evicted (its hash forgotten) only when a fresh block is needed and it is the
least recently freed. Free blocks that hold no cached prefix are handed out first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from workers.scheduler.core.sequence import Sequence


def chain_hash(prev: bytes, token_ids: Tokens[int]) -> bytes:
    """The hash of a block of `token_ids` after the prefix hashed as `prev`. A keyed digest,
    not Python's hash(): colliding prompts could otherwise read each other's cache."""
    return hashlib.blake2b(prev + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, the next one to hand out first (cached ones in LRU order).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any sequence (including evictable cached ones)."""
        return len(self.free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- a sequence's blocks -----------------------------------------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """Give `seq` (holding no blocks) the cached blocks of its longest cached prefix;
        they count as computed."""
        assert not seq.block_table, f"{seq} already holds blocks"
        if self.enable_prefix_caching:
            self._hash_full_blocks(seq)
            limit = len(seq) - 1  # the last token is never cached
            if seq.logprobs is not None:  # nor positions whose prompt logprobs are wanted
                limit = min(limit, seq.logprobs.num_cacheable_tokens)
            max_blocks = limit // self.block_size
            for block_hash in seq.block_hashes[:max_blocks]:
                block_id = self.cached.get(block_hash)
                if block_id is None:
                    break
                self._ref(block_id)
                seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for `seq` to hold the K/V of its first `num_tokens` tokens."""
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold its first `num_tokens` tokens."""
        while len(seq.block_table) < self.num_blocks_for(num_tokens):
            seq.block_table.append(self._take_free_block())

    def cache_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Register `seq`'s blocks that became full and computed since it had
        `num_computed_before` computed tokens."""
        if not self.enable_prefix_caching:
            return
        self._hash_full_blocks(seq)
        bs = self.block_size
        first, end = num_computed_before // bs, seq.num_computed_tokens // bs
        for block_id, block_hash in zip(
            seq.block_table[first:end], seq.block_hashes[first:end], strict=True
        ):
            block = self.blocks[block_id]
            # A twin computed at the same time keeps its first copy; this one stays private.
            if block.hash is None and block_hash not in self.cached:
                block.hash = block_hash
                self.cached[block_hash] = block_id

    def deallocate(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; its cached ones stay reusable until evicted."""
        # Last block first, so a prefix's tail is evicted before its head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:  # nothing worth keeping: hand it out first
                    self.free.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (after new weights, or on /flush_cache); blocks in use
        stay with their sequences, unshared. Returns how many blocks were cached."""
        num_cached = len(self.cached)
        for block_id in self.cached.values():
            self.blocks[block_id].hash = None
        self.cached.clear()
        return num_cached

    # -- internals ---------------------------------------------------------------------------
    def _hash_full_blocks(self, seq: Sequence) -> None:
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), len(seq) // bs):
            prev = hashes[-1] if hashes else b""
            hashes.append(chain_hash(prev, seq.token_ids[i * bs : (i + 1) * bs]))

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the least recently used cached prefix block
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
