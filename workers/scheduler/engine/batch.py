"""The batch contract between the model runner and the model: the index tensors of one step
(`AttentionBatch`), the sequences attended together (`AttentionGroup`) and a layer's KV cache
(`LayerCache`). The runner builds them (model_runner.py); every layer of the forward reads them
(model/llama.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionGroup:
    """Sequences of a step attended in one call: their queries laid out padded as [B, Lq]
    (Lq = most new tokens of one of them), their contexts as whole cache blocks ([B, Lk],
    Lk = blocks of the longest context x block size); `mask` hides padding and the future."""

    token_index: torch.Tensor  # [Tg] rows of the step's T new tokens that belong here
    padded_index: torch.Tensor  # [Tg] their rows in the padded [B * Lq] layout
    # The contexts' blocks as rows of a cache layer seen as [kv_heads * blocks, block_size *
    # head_dim], head-major ([kv_heads, B, Lk / block_size] flattened): one gather gives
    # [kv_heads, B, Lk, head_dim], each (kv head, sequence) a contiguous [Lk, head_dim].
    kv_rows: torch.Tensor
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool, True = attend
    # Groups that take `Attention._attend_matmuls` (decodes of enough sequences, prefill
    # chunks over short contexts): the mask as a score bias [1, B, 1, Lq, Lk] (0 = attend,
    # -inf = padding or the future); None = the general (SDPA) path.
    score_bias: torch.Tensor | None = None
    # Decode groups that take the paged kernel (paged_decode.py): each sequence's block
    # table [B, blocks] and context length [B], int32; the cache is read in place.
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """Index tensors of one step, shared by every layer (built by the model runner). A
    sequence brings its new tokens at positions [num_computed, num_computed + n) — a prefill
    chunk or one decode token — and attends to its whole cached context. Decodes and prefill
    chunks form separate groups, so a long chunk does not pad every decode to its length."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    groups: list[AttentionGroup]
    last_index: torch.Tensor  # [B] index in T of each sequence's last new token
    block_size: int


def score_bias(mask: torch.Tensor) -> torch.Tensor:
    """A group's mask [B, 1, Lq, Lk] as the score bias `Attention._attend_matmuls` adds,
    [1, B, 1, Lq, Lk]: 0 where a query attends, -inf elsewhere."""
    bias = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.view(1, mask.shape[0], 1, *mask.shape[2:])


# A layer's K and V caches, [kv_heads, slots, head_dim] each. Separate tensors, not views of
# one: torch.compile (compiled.py) writes new tokens into a graph input in place, but a view
# of a larger input makes it rebuild (copy) the whole base on every write.
LayerCache = tuple[torch.Tensor, torch.Tensor]
