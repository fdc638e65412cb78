"""Our own Llama-family forward over a paged KV cache (Llama, SmolLM2; torch lives here).

The model runs on a flat batch of T new tokens from B sequences. Each layer writes the new
tokens' K/V into the cache slots the block manager assigned, then attends over each
sequence's whole context gathered from the cache, so prefill, decode, prefill chunks and
prefixes reused from the cache are one code path. The families' differences are flags of
`ModelArgs` (model/config.py); checkpoint.py loads the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.scheduler.engine.batch import AttentionBatch, AttentionGroup, LayerCache
from workers.scheduler.kernels import rms_norm
from workers.scheduler.kernels.paged_decode import paged_decode
from workers.scheduler.model.config import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's: x * rsqrt(mean(x²) + eps) in fp32, then weight * (that in x's dtype). One
        # fused kernel, bit-identical, and faster than the separate ops.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if rms_norm.takes(x, self.weight):  # eager bf16 on CPU: one C call
            return rms_norm.rms_norm_bf16(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rope_tables(args: ModelArgs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position, [max_positions, head_dim] (HF's rotate-half layout),
    sin with its first half negated (see `apply_rope`)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    positions = torch.arange(args.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    # rotate_half(x) = [-x2, x1] = roll(x, half) * [-1.., +1..]: the sign goes into sin.
    sign = torch.ones(dim).index_fill_(0, torch.arange(dim // 2), -1.0)
    return emb.cos().to(dtype), (emb.sin() * sign).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, bit for bit, in 4 ops instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.q_size, self.kv_size = (
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        # bf16/fp16 on CPU: q/k/v upcast to fp32 for SDPA, or not (layers/attention_tuning.py
        # times both at load; which is faster depends on the CPU).
        self.upcast_sdpa = True

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: LayerCache,
    ) -> torch.Tensor:
        num_tokens, num_qk_heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :num_qk_heads], qkv[:, num_qk_heads:]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k heads rotated in one go: half the ops per layer of rotating them apart.
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        k_cache, v_cache = kv_cache  # [kv_heads, slots, head_dim] each
        # (bf16 under an fp32 model with --kv-cache-dtype bfloat16: rounded as stored)
        k_cache.index_copy_(1, batch.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, batch.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
        out = self._attend(q, k_cache, v_cache, batch)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        all_decodes = len(batch.groups) == 1 and batch.groups[0].mask.shape[2] == 1
        for group in batch.groups:
            if group.block_tables is not None and group.context_lens is not None:
                rows = q if all_decodes else q[group.token_index]
                attended = paged_decode(
                    rows, k_cache, v_cache, group.block_tables, group.context_lens, batch.block_size
                )
                if all_decodes:
                    return attended
                out[group.token_index] = attended
                continue
            # Whole blocks (2 KB rows in bf16, not 128 B ones): far fewer, larger copies
            # than gathering slot by slot.
            keys, values = (
                cache.view(-1, batch.block_size * self.head_dim)
                .index_select(0, group.kv_rows)
                .view(self.num_kv_heads, group.mask.shape[0], -1, self.head_dim)
                for cache in (k_cache, v_cache)
            )  # [kv_heads, B, Lk, head_dim]
            if all_decodes:  # query rows already in order: no selection, no scatter
                return self._attend_group(q, keys, values, group)
            out[group.token_index] = self._attend_group(q[group.token_index], keys, values, group)
        return out

    def _attend_group(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: AttentionGroup
    ) -> torch.Tensor:
        """Attention output [Tg, heads, head_dim] of the group's query rows `q`."""
        num_seqs, _, max_q, _ = group.mask.shape
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bf16 cache under fp32
        if max_q == 1:  # decodes: one query per sequence, no padding
            queries = q.unsqueeze(1)
        else:
            queries = q.new_zeros(num_seqs * max_q, self.num_heads, self.head_dim)
            queries[group.padded_index] = q
            queries = queries.view(num_seqs, max_q, self.num_heads, self.head_dim)
        if group.score_bias is not None:
            attended = self._attend_matmuls(queries, keys, values, group.score_bias)
        else:
            attended = self._attend_sdpa(queries, keys, values, group.mask)
        return attended if max_q == 1 else attended[group.padded_index]

    def _attend_sdpa(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Padded queries [B, Lq, heads, d] over contexts [kv_heads, B, Lk, d] through SDPA;
        [B * Lq, heads, d]."""
        dtype = queries.dtype
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [B, kv_heads, Lk, d]
        if self.upcast_sdpa and _low_precision_cpu(queries):
            queries, keys, values = queries.float(), keys.float(), values.float()
        attended = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        return attended.reshape(-1, self.num_heads, self.head_dim).to(dtype)

    def _attend_matmuls(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        score_bias: torch.Tensor,
    ) -> torch.Tensor:
        """Padded queries [B, Lq, heads, d] (bf16/fp16 on CPU, as the model runner decides)
        as two batched matmuls over the [kv_heads, B, Lk, head_dim] contexts, each (kv head,
        sequence) one matrix of its group's query rows; scores and softmax in fp32;
        [B * Lq, heads, d]. It beats SDPA on many decodes, where SDPA with the fp32 upcast
        spends most of its time copying K/V, and on short prompts, where SDPA's CPU kernel
        neither skips the masked half nor runs bf16 faster than fp32 (measured in
        bench/README.md). Scores take Lq x Lk floats a query head, so only short contexts
        come here (layers/attention_tuning.py)."""
        num_seqs, max_q = queries.shape[:2]
        kv_heads, group_size = self.num_kv_heads, self.num_heads // self.num_kv_heads
        # Query head h reads kv head h // group_size (as SDPA's enable_gqa): rows of one kv
        # head's matrix are its group's heads, then positions. (A view when Lq is 1.)
        grouped = queries.view(num_seqs, max_q, kv_heads, group_size, self.head_dim)
        grouped = grouped.permute(2, 0, 3, 1, 4).reshape(kv_heads, num_seqs, -1, self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float()  # [kvh, B, G*Lq, Lk]
        scores = scores.view(kv_heads, num_seqs, group_size, max_q, -1)
        scores = scores.mul_(self.head_dim**-0.5).add_(score_bias)
        probs = torch.softmax(scores, dim=-1).to(queries.dtype).flatten(2, 3)
        attended = torch.matmul(probs, values)  # [kvh, B, G*Lq, d]
        attended = attended.view(kv_heads, num_seqs, group_size, max_q, self.head_dim)
        return attended.permute(1, 3, 0, 2, 4).reshape(-1, self.num_heads, self.head_dim)


def _low_precision_cpu(x: torch.Tensor) -> bool:
    return x.dtype != torch.float32 and x.device.type == "cpu"


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        size, bias = args.intermediate_size, args.mlp_bias
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * size, bias=bias)
        self.down_proj = nn.Linear(size, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: LayerCache,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    lm_head: nn.Module  # an nn.Linear, or a wrapper (layers/quantization.py, layers/prepacked.py)

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(args, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, batch: AttentionBatch, kv_cache: Sequence[LayerCache]
    ) -> torch.Tensor:
        """Final (normed) hidden states [T, hidden] of the new tokens; `kv_cache` holds
        each layer's K and V. `compute_logits` turns rows into logits."""
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            x = layer(x, cos, sin, batch, layer_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of N rows of final hidden states."""
        return self.lm_head(hidden).float()
