"""The model runner: turns one scheduled step into input tensors, runs the forward over the
paged KV cache and samples one token per sequence. Only this side of the scheduler imports
torch (with llama.py and sampler.py); the loop sees it through the `ModelRunner` protocol.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from workers.scheduler.llama import AttentionBatch, LlamaForCausalLM, ModelArgs, load_model
from workers.scheduler.sampler import sample
from workers.scheduler.sequence import Sequence

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_args(model_path: str) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((Path(model_path) / "config.json").read_text()))


class TorchModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_kv_blocks: int, block_size: int) -> None:
        """Allocates the KV cache: [layers, 2 (K, V), num_kv_blocks * block_size slots,
        kv_heads, head_dim], zeroed so that padding slots never carry NaNs."""
        self.model = model
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        args, weight = model.args, model.embed_tokens.weight
        self.device = weight.device
        self.kv_cache = torch.zeros(
            args.num_layers,
            2,
            num_kv_blocks * block_size,
            args.num_kv_heads,
            args.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    @classmethod
    def load(
        cls,
        model_path: str,
        num_kv_blocks: int,
        block_size: int,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int = 0,
    ) -> TorchModelRunner:
        if num_threads:
            torch.set_num_threads(num_threads)
        started = time.monotonic()
        model = load_model(model_path, DTYPES[dtype], device)
        logger.info("loaded weights from %s in %.1fs", model_path, time.monotonic() - started)
        runner = cls(model, num_kv_blocks, block_size)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.0f MiB, %s on %s)",
            num_kv_blocks,
            block_size,
            runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**20,
            dtype,
            device,
        )
        return runner

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """The next token of each of `seqs`. A prefill feeds every token past the cached
        ones, a decode only each sequence's last token."""
        starts = [seq.num_cached_tokens if is_prefill else len(seq) - 1 for seq in seqs]
        input_ids = torch.tensor(
            [t for seq, start in zip(seqs, starts, strict=True) for t in seq.token_ids[start:]],
            dtype=torch.long,
            device=self.device,
        )
        batch = self._prepare(seqs, starts)
        logits = self.model(input_ids, batch, self.kv_cache)
        return sample(logits, [s.sampling for s in seqs], [s.num_completion_tokens for s in seqs])

    def _prepare(self, seqs: list[Sequence], starts: list[int]) -> AttentionBatch:
        device, bs = self.device, self.block_size
        kv_lens = torch.tensor([len(seq) for seq in seqs], device=device)
        start = torch.tensor(starts, device=device)
        q_lens = kv_lens - start
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
        # Cache slot of every context position of every sequence: [B, max_kv].
        max_blocks = -(-max_kv // bs)
        tables = torch.tensor(
            [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs],
            device=device,
        )
        offsets = torch.arange(bs, device=device)
        kv_slots = (tables.unsqueeze(-1) * bs + offsets).flatten(1)[:, :max_kv]
        # Padded query layout [B, max_q]: row j of sequence b is position start_b + j.
        q_pos = start.unsqueeze(1) + torch.arange(max_q, device=device)
        is_query = torch.arange(max_q, device=device) < q_lens.unsqueeze(1)
        key_pos = torch.arange(max_kv, device=device)
        # Padding query rows still see key 0, so no softmax row is empty (NaN).
        mask = (key_pos <= q_pos.unsqueeze(-1)) & (key_pos < kv_lens.view(-1, 1, 1))
        query_index = is_query.flatten().nonzero().squeeze(1)
        positions = q_pos.flatten()[query_index]
        seq_of_token = query_index // max_q
        return AttentionBatch(
            positions=positions,
            slot_mapping=kv_slots[seq_of_token, positions],
            query_index=query_index,
            kv_slots=kv_slots,
            mask=mask.unsqueeze(1),
            last_index=torch.cumsum(q_lens, 0) - 1,
        )
