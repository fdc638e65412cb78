"""int8 weights x bf16 activations through AMX-BF16 (int8_bf16.py): its own math in every
tile remainder and token group, bf16 and fp32, the dense weights within int8's tolerance,
one op under torch.compile, and where `w8a8_int8` offers it. On a CPU without AMX-BF16 the
kernel is not offered (`fits` is False), which the last test checks too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.scheduler.kernels import int8_bf16
from workers.scheduler.kernels.int8_bf16 import Int8Bf16
from workers.scheduler.layers import quantization
from workers.scheduler.layers.quantization import int8_channels
from workers.scheduler.layers.tiered import TieredLinear

pytestmark = pytest.mark.ccompiler

HERE = int8_bf16.fits(torch.zeros(16, 32))
needs_amx = pytest.mark.skipif(not HERE, reason="this CPU has no AMX-BF16 (or no C compiler)")


def of(weight: torch.Tensor) -> Int8Bf16:
    """The kernel for a float [out, in] weight, as `w8a8_int8` makes it."""
    return Int8Bf16(*int8_channels(weight.detach().float()))


def unpacked(kernel: Int8Bf16) -> torch.Tensor:
    """The int8 weight [out, in] back from its packed layout."""
    blocks, pairs, block, pair = kernel.packed.shape
    return kernel.packed.transpose(1, 2).reshape(blocks * block, pairs * pair)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 64, 65, 70])
def test_the_kernel_computes_its_own_math(dtype: torch.dtype, tokens: int) -> None:
    """x rounded to bf16, times the int8 weights summed in fp32, times each channel's scale:
    up to fp32's summation order (bf16 out: its rounding). 65 and 70 tokens: a second group
    of tiles, the last one short."""
    torch.manual_seed(tokens)
    weight = torch.randn(48, 96)  # 3 blocks of 16 channels, 3 chunks of 32 inputs
    kernel = of(weight)
    x = torch.randn(tokens, 96).to(dtype)
    got = kernel(x)
    assert got.dtype == dtype and got.shape == (tokens, 48)
    expected = (x.bfloat16().double() @ unpacked(kernel).double().t()) * kernel.scale.double()
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()


@needs_amx
def test_the_kernel_follows_the_dense_weights_within_int8() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(1536, 576, bias=False)  # the model's down_proj
    x = torch.randn(16, 1536)
    x[:, [3, 700]] *= 80  # down_proj's input has outliers; bf16 activations keep them
    exact = dense(x).detach()
    error = float((of(dense.weight)(x) - exact).abs().max() / exact.abs().max())
    assert error < 0.01


@needs_amx
def test_a_compiled_forward_runs_the_kernel_inside_one_graph() -> None:
    torch.manual_seed(0)
    kernel = of(torch.randn(64, 128))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(kernel(torch.sin(x))) * 2

    x = torch.randn(8, 128)
    torch.testing.assert_close(torch.compile(forward, fullgraph=True)(x), forward(x))


def test_shapes_out_of_whole_blocks_are_not_taken() -> None:
    assert not int8_bf16.fits(torch.zeros(24, 64))  # 24 channels: not whole blocks of 16
    assert not int8_bf16.fits(torch.zeros(32, 48))  # 48 inputs: not whole chunks of 32
    with pytest.raises(ValueError):
        of(torch.zeros(24, 64))


def test_w8a8_int8_offers_it_to_down_proj_where_it_runs() -> None:
    """Only to down_proj (the projection whose activations stay in 16 bits), and only where
    the kernel runs here."""
    dense = nn.Linear(64, 32, bias=False)
    for name in ("qkv_proj", "down_proj"):
        kernels = quantization._decoder_kernels(name, dense, torch.ones(64))
        offered = "int8_bf16" in kernels
        assert offered == (name == "down_proj" and HERE)
        if offered:
            tiered = TieredLinear(dense, kernels)
            x = torch.randn(3, 64)
            got = tiered.run("int8_bf16", x)
            torch.testing.assert_close(got, dense(x).detach(), rtol=0.02, atol=0.02)
