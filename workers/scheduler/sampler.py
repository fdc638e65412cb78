"""Batched sampling of one token per sequence from its logits (torch; model-runner side).

Greedy (temperature 0), temperature, top-k and top-p, all on tensors. Sampling draws
exponential noise and takes argmax(probs / noise), which picks token i with probability
probs[i]. A request with a `seed` draws its noise from a generator seeded by (seed, output
index), so its tokens depend on nothing else in the batch, and a recomputed or reclaimed
request continues exactly as it would have.
"""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the 64-bit seed space


def sample(
    logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
) -> list[int]:
    """One token id per row of `logits` [B, vocab]; `output_index[i]` is the index of the
    token being sampled in row i's output (it keys the seeded noise)."""
    greedy = logits.argmax(dim=-1)
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    is_greedy = temperature <= 0
    if bool(is_greedy.all()):
        return greedy.tolist()
    logits = logits.float() / temperature.clamp_min(1e-5).unsqueeze(1)
    logits = _top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    noise = _exponential_noise(probs, params, output_index)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled).tolist()


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    # top-p on the distribution that top-k left; the most likely token always stays.
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=device, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before > p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _exponential_noise(
    probs: torch.Tensor, params: list[SamplingParams], output_index: list[int]
) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, (p, index) in enumerate(zip(params, output_index, strict=True)):
        if p.seed is not None:
            generator = torch.Generator(device=probs.device)
            generator.manual_seed((p.seed * _GOLDEN + index) % 2**64)
            noise[row].exponential_(generator=generator)
    return noise.clamp_min_(1e-20)
