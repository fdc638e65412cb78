"""`--quantization auto` (the default): serve a checkpoint at the precision it was stored in.

A GGUF whose decoder projections are stored in 4 bits or fewer (Q4_0, Q4_1, Q4_K, IQ4, Q3_K,
...) lost what a dense copy could keep, so on CPU those projections take the int4 kernels
(groups of 32 with a scale and a zero: Q4_1's own layout, so its weights come back on the
same grid) and the LM head the int8 one where the GGUF stored it in 8 bits or fewer. On
CPUs with AMX-BF16 they (and the head) also get int8 weights x bf16 activations
(kernels/int8_bf16.py): half of bf16's bytes for middle-sized steps, where int4's kernel
is compute-bound; int8 per output channel holds a 4-bit group's values within a small
part of the group's step (tests/model/test_auto_quantization.py). Each step size takes
whichever of them or the dense weights was timed fastest (tiered.py). Projections stored
in more bits (a Q4_K_M's Q6_K ones, a Q8_0 or F16 file) stay dense, and so does any
checkpoint that is not a GGUF, and anything on CUDA. The exact reference stays
`--dtype float32 --quantization none`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from shared.model_files import gguf_tensor_types

logger = logging.getLogger(__name__)

# llama.cpp's types of at most 4 bits a weight, by name prefix.
_FOUR_BITS = ("Q4_", "IQ4_", "Q3_", "IQ3_", "Q2_", "IQ2_", "IQ1_", "TQ1_", "TQ2_", "MXFP4")
_EIGHT_BITS = (*_FOUR_BITS, "Q5_", "Q6_", "Q8_")
# Our fused projections and the GGUF tensors each is made of.
_GGUF_PARTS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
HEAD = "lm_head"


@dataclass(frozen=True)
class QuantizationPlan:
    method: str  # "none", "int4" or "w8a8_int8" (layers/quantization.py)
    # Projections that stay dense: (layer index, name), or (-1, HEAD).
    keep_dense: frozenset[tuple[int, str]] = field(default_factory=frozenset)
    int8_bf16_too: bool = False  # int4's projections and head also in int8 x bf16 (AMX)


def plan_quantization(quantization: str, device: str, model_path: str) -> QuantizationPlan:
    """`quantization` as set, or for "auto" what the checkpoint at `model_path` was stored in."""
    if quantization != "auto":
        return QuantizationPlan(quantization)
    types = gguf_tensor_types(model_path)
    if torch.device(device).type != "cpu" or not types:
        return QuantizationPlan("none")
    keep_dense = {
        (int(name.split(".")[1]), ours)
        for name, kind in types.items()
        if name.startswith("blk.")
        for ours, parts in _GGUF_PARTS.items()
        if name.split(".")[2] in parts and not kind.startswith(_FOUR_BITS)
    }
    layers = {int(name.split(".")[1]) for name in types if name.startswith("blk.")}
    compact = len(layers) * len(_GGUF_PARTS) - len(keep_dense)
    if compact == 0:
        return QuantizationPlan("none")
    head = types.get("output", types.get("token_embd", "F32"))
    if not head.startswith(_EIGHT_BITS):
        keep_dense.add((-1, HEAD))
    logger.info(
        "quantization auto: int4 for the %d projections the GGUF stores in 4 bits or fewer "
        "(%s), %d kept dense; LM head (%s) %s",
        compact,
        ", ".join(sorted({k for k in types.values() if k.startswith(_FOUR_BITS)})),
        len(keep_dense - {(-1, HEAD)}),
        head,
        "dense" if (-1, HEAD) in keep_dense else "int8",
    )
    return QuantizationPlan("int4", frozenset(keep_dense), int8_bf16_too=True)
