"""The W8A8 and W8A16 projections in C (w8a8.py): their own math, the dense weights
within the int8 tolerance, every tile remainder, bf16 and fp32, no saturation or overflow at
the extremes, and the portable loops as well as the AVX2 and AVX512-VNNI ones (where this
CPU has them)."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
from torch import nn

from workers.scheduler.kernels.w8a8 import NO_AMX, FusedW8A8, build_kernel, kernel_fits
from workers.scheduler.layers import quantization
from workers.scheduler.layers.quantization import DynamicInt8, w8a8_projection

pytestmark = pytest.mark.ccompiler

# Each path of the C source as this CPU can build it: the portable loops, AVX2's,
# AVX512-VNNI's and AMX's (`w8a8_vectorized()`, `w8a8_amx()`).
PATHS = {(0, 0): "portable", (2, 0): "avx2", (1, 0): "vnni", (1, 1): "amx"}


def _path(lib: ctypes.CDLL) -> tuple[int, int]:
    return lib.w8a8_vectorized(), lib.w8a8_amx()


def _builds() -> list[tuple[str, ...]]:
    if platform.machine() != "x86_64":
        return []
    found: dict[tuple[int, int], tuple[str, ...]] = {}
    for flags in (("-mno-avx2",), ("-mno-avx512f",), NO_AMX, ()):
        lib = build_kernel(flags)
        if lib is not None:
            found.setdefault(_path(lib), flags)
    return list(found.values())


def _path_name(flags: tuple[str, ...]) -> str:
    lib = build_kernel(flags)
    return PATHS[_path(lib)] if lib is not None else "unbuilt"


BUILDS = pytest.mark.parametrize("flags", _builds(), ids=_path_name)


def fused(
    dense: nn.Linear, input_max: torch.Tensor, flags: tuple[str, ...], wide: bool = False
) -> FusedW8A8:
    """`w8a8_kernel`'s FusedW8A8 (`wide`: W8A16) for `dense`, on the library built with
    `flags`."""
    lib = build_kernel(flags)
    if lib is None:
        pytest.skip("no C compiler here")
    kernel = w8a8_projection(dense.weight, input_max, lib, wide)
    assert isinstance(kernel, FusedW8A8)
    return kernel


def unpack(kernel: FusedW8A8) -> torch.Tensor:
    """The int8 weight [out, in] back from its packed layout."""
    blocks, steps, tile, step = kernel.packed.shape
    return kernel.packed.transpose(1, 2).reshape(blocks * tile, steps * step)


def activation_levels(kernel: FusedW8A8) -> int:
    lib = build_kernel()
    assert lib is not None
    return lib.w8a16_activation_levels(kernel.in_features) if kernel.wide else 127


def its_own_math(kernel: FusedW8A8, dense: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: per-token int8 (W8A16: int16) activations of x * inverse
    smoothing (scaled in fp32, rounded half to even), exact integer products, the outliers
    in full."""
    rows = x.float() * kernel.inverse_smooth
    levels = activation_levels(kernel)
    scale = rows.abs().amax(1, keepdim=True) / levels
    q_x = torch.round(rows * (1 / scale)).clamp(-levels, levels).double()
    products = (q_x @ unpack(kernel).double().t()) * scale.double() * kernel.scale.double()
    outliers = kernel.outliers.long()
    weight = dense.weight.detach().double()[:, outliers]
    return products + x.double()[:, outliers] @ weight.t()


WIDTHS = pytest.mark.parametrize("wide", [False, True], ids=["w8a8", "w8a16"])


@BUILDS
@WIDTHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 7, 17, 35])
# 132 inputs: 33 steps of 4 (not whole AMX rows of 64: its build takes the vpdpbusd tile)
@pytest.mark.parametrize("in_features", [132, 192])
def test_the_kernel_computes_its_own_math(
    flags: tuple[str, ...], wide: bool, dtype: torch.dtype, tokens: int, in_features: int
) -> None:
    torch.manual_seed(tokens)
    dense = nn.Linear(in_features, 192, bias=False)  # 3 tiles of 64 outputs
    x = torch.randn(tokens, in_features)
    x[:, [5, 60]] *= 40  # outlier channels
    kernel = fused(dense, x.abs().amax(0), flags, wide)
    x = x.to(dtype)
    got = kernel(x)
    assert got.dtype == dtype and got.shape == (tokens, 192)
    expected = its_own_math(kernel, dense, x)
    # fp32: a rounding tie may land apart (one activation level); bf16: the output's rounding
    tolerance = 2e-3 if dtype == torch.float32 else 1e-2
    assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [16, 17, 31, 64])
def test_amx_tiles_give_the_vnni_tiles_bits(dtype: torch.dtype, tokens: int) -> None:
    """Both sum the same integer products exactly and share the dequantizing pass, so an
    AMX build's output equals the vpdpbusd build's bit for bit, in whole 16-token tiles and
    in a shorter last one (steps of 16 tokens or more: `AMX_MIN_TOKENS`)."""
    amx, vnni = build_kernel(), build_kernel(NO_AMX)
    if amx is None or vnni is None or _path(amx) != (1, 1) or _path(vnni) != (1, 0):
        pytest.skip("this CPU has no AMX-INT8 (or the kernel lacks it)")
    torch.manual_seed(tokens)
    dense = nn.Linear(576, 960, bias=False)  # the model's qkv projection
    x = torch.randn(tokens, 576)
    x[:, [7, 300]] *= 50
    input_max = x.abs().amax(0)
    x = x.to(dtype)
    got = w8a8_projection(dense.weight, input_max, amx)(x)
    assert torch.equal(got, w8a8_projection(dense.weight, input_max, vnni)(x))


@BUILDS
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_widest_products_do_not_saturate(flags: tuple[str, ...], sign: float) -> None:
    """Every activation and weight at its widest level, all of one sign: AVX2's byte
    products would saturate their int16 pairs with 8-bit weights (255 * 127 * 2); with the
    levels its build asks for they are exact."""
    dense = nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        dense.weight.fill_(0.01)
    kernel = fused(dense, torch.ones(256), flags)
    lib = build_kernel(flags)
    assert lib is not None
    assert int(unpack(kernel).abs().max()) == lib.w8a8_weight_levels()
    x = torch.full((17, 256), sign)  # AMX's tiles too, where the build has them
    torch.testing.assert_close(kernel(x).double(), its_own_math(kernel, dense, x))
    torch.testing.assert_close(kernel(x), dense(x).detach(), rtol=1e-5, atol=1e-5)


@BUILDS
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_w8a16_sums_stay_within_int32_at_the_widest_levels(
    flags: tuple[str, ...], sign: float
) -> None:
    """W8A16 over 4096 inputs, every weight at 127 and every activation at its widest level:
    the sums come within 1% of int32's range and do not wrap."""
    in_features = 4096
    dense = nn.Linear(in_features, 16, bias=False)
    with torch.no_grad():
        dense.weight.fill_(0.01)
    kernel = fused(dense, torch.ones(in_features), flags, wide=True)
    levels = activation_levels(kernel)
    assert 0.99 * 2**31 < 127 * levels * (in_features - 16) < 2**31  # 16 channels are outliers
    x = torch.full((3, in_features), sign)
    # fp32 dequantization of sums near 2**31: exact up to its rounding (an overflow wraps)
    torch.testing.assert_close(
        kernel(x).double(), its_own_math(kernel, dense, x), rtol=1e-5, atol=0
    )


@BUILDS
def test_the_kernel_follows_the_dense_weights_as_fbgemm_does(flags: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    dense = nn.Linear(256, 128, bias=False)
    x = torch.randn(16, 256)
    x[:, [3, 40, 77]] *= 60
    input_max = x.abs().amax(0)
    exact = dense(x).detach()
    errors = {
        name: float((kernel(x) - exact).abs().max() / exact.abs().max())
        for name, kernel in (
            ("fused", fused(dense, input_max, flags)),
            ("wide", fused(dense, input_max, flags, wide=True)),
            ("fbgemm", DynamicInt8(dense.weight, input_max)),
        )
    }
    # 8-bit activations (fbgemm keeps 7): at least as close as fbgemm's, and close; 16-bit
    # activations with 8-bit weights closer still
    assert errors["fused"] < 0.004 and errors["fused"] <= errors["fbgemm"] * 1.1, errors
    assert errors["wide"] < errors["fused"], errors


def test_shapes_out_of_whole_tiles_take_fbgemm() -> None:
    dense = nn.Linear(128, 72)  # 72 outputs: not whole tiles (64, or 16 on AVX2)
    assert not kernel_fits(dense.weight)
    assert isinstance(w8a8_projection(dense.weight, torch.ones(128)), DynamicInt8)


def test_without_avx2_the_kernel_is_not_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    portable = build_kernel(("-mno-avx2",))
    if portable is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(quantization, "kernel_fits", lambda weight, wide=False: False)
    dense = nn.Linear(128, 128)
    assert isinstance(w8a8_projection(dense.weight, torch.ones(128)), DynamicInt8)
    assert portable.w8a8_vectorized() == 0


@BUILDS
@WIDTHS
def test_a_compiled_forward_runs_the_kernel_inside_one_graph(
    flags: tuple[str, ...], wide: bool
) -> None:
    """`--enable-torch-compile` with decode batches on the kernel's route: the kernel is
    one op of the graph (fullgraph: a graph break fails), with the eager result."""
    torch.manual_seed(0)
    dense = nn.Linear(128, 128, bias=False)
    kernel = fused(dense, torch.ones(128), flags, wide)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(kernel(torch.sin(x))) * 2

    x = torch.randn(8, 128)
    torch.testing.assert_close(torch.compile(forward, fullgraph=True)(x), forward(x))
