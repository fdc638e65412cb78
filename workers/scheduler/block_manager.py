"""Paged KV cache accounting: which fixed-size blocks of the cache tensor each sequence owns.

Pure Python. The model runner writes token i of a sequence into slot
`block_table[i // block_size] * block_size + i % block_size` of the cache. Prefix reuse
(hashing full blocks so that shared prompt prefixes map to the same block) fits in
`allocate`, which would then set `seq.num_cached_tokens`.
"""

from __future__ import annotations

from collections import deque

from workers.scheduler.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for the KV of all of `seq`'s tokens (its prefill)."""
        return self.num_blocks_for(len(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table, f"{seq} already holds blocks"
        for _ in range(self.num_blocks_for(len(seq))):
            seq.block_table.append(self.free_block_ids.popleft())
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Room to write the KV of `seq`'s last token (its next decode step)."""
        needed = self.num_blocks_for(len(seq)) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Give `seq` a new block when its last token starts one."""
        while len(seq.block_table) < self.num_blocks_for(len(seq)):
            seq.block_table.append(self.free_block_ids.popleft())

    def deallocate(self, seq: Sequence) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
