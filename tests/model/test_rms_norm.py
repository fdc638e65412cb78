"""The bf16 RMSNorm kernel (rms_norm.c) against the eager torch ops it replaces, and where
`RMSNorm` takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.scheduler.kernels import rms_norm
from workers.scheduler.model.llama import RMSNorm

pytestmark = [
    pytest.mark.ccompiler,
    pytest.mark.skipif(
        rms_norm.rms_norm_library() is None, reason="no C compiler: no RMSNorm kernel"
    ),
]


def _torch_ops(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (7, 64), (300, 576), (33, 33), (0, 64)])
def test_the_kernel_rounds_where_the_torch_ops_round(rows: int, dim: int) -> None:
    """Equal to the last bit but where the fp32 sum's order tips a rounding (measured: 1
    element in 1.2 million at 2048 x 576; rounding once instead of twice, as a bf16
    `F.rms_norm` with the weight does, leaves ~25% of elements off by one step)."""
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 4).to(torch.bfloat16)
    x[:, :3] = torch.tensor([0.0, 1e-30, -3e4])  # zeros, tiny and large values in every row
    weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(torch.bfloat16)
    ours, theirs = rms_norm.rms_norm_bf16(x, weight, 1e-5), _torch_ops(x, weight, 1e-5)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    if rows:
        assert (ours == theirs).float().mean() >= 0.999
    torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=0)  # one bf16 step at most


def test_a_zero_row_stays_finite() -> None:
    weight = torch.ones(64, dtype=torch.bfloat16)
    out = rms_norm.rms_norm_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), weight, 1e-6)
    assert torch.equal(out, torch.zeros_like(out))


def test_rms_norm_takes_the_kernel_for_contiguous_bf16_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, ...]] = []
    kernel = rms_norm.rms_norm_bf16

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return kernel(x, weight, eps)

    monkeypatch.setattr(rms_norm, "rms_norm_bf16", counted)
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
        x = torch.randn(5, 3, 16, generator=gen).to(torch.bfloat16)
        expected = _torch_ops(x, norm.weight, 1e-6)
        assert torch.equal(norm(x), expected)  # contiguous bf16: the kernel
        assert torch.equal(norm(x[:, 1:]), expected[:, 1:])  # strided (Qwen3's q/k): torch
        fp32 = RMSNorm(16, 1e-6)
        fp32(x.float())  # fp32, the exact reference: torch
    assert calls == [(5, 3, 16)]
