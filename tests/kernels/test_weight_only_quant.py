"""Weight-only formats (int8 per channel, int4 in torch's CPU packed layout, NF4) and the int8
KV cache codes: round-trip error bounds as properties over random tensors (with outliers and
all-zero groups), then every GEMM against an fp64 matmul of its own dequantized weight.

Bounds: a symmetric or min/max code is off by at most half a step, so |w - deq(w)| <= step/2
(+ a rounding slack when the scale is stored in fp16). NF4 levels are not evenly spaced: the
bound is absmax x (largest gap between adjacent levels) / 2. GEMM tolerances: fp32 paths
1e-5 against fp64 (same weights, fp32 summation over K <= 512); bf16 packed kernels 2e-2
relative to the output's scale (bf16 activations and outputs round to 8 bits).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import ops
from kernels.kv_cache_torch import dequantize_kv_int8, quantize_kv_int8
from kernels.quant_weight_only_torch import (
    NF4_LEVELS,
    dequantize_int4_codes,
    dequantize_int8_weight,
    dequantize_nf4,
    pack_int4_for_cpu,
    quantize_int4_codes,
    quantize_int8_weight,
    quantize_nf4,
)

MAX_NF4_HALF_GAP = max(b - a for a, b in itertools.pairwise(NF4_LEVELS)) / 2


@st.composite
def weights(draw: st.DrawFn, group_size: int) -> torch.Tensor:
    """[N, K] Gaussian weights with optional outliers and all-zero rows and groups."""
    rows = draw(st.integers(1, 6))
    num_groups = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    w = torch.randn(rows, num_groups * group_size, generator=g) * scale
    if draw(st.booleans()):  # an outlier 100x the rest
        w[0, draw(st.integers(0, w.shape[1] - 1))] = 100 * scale
    if draw(st.booleans()):
        w[-1, :group_size] = 0  # an all-zero group
    if draw(st.booleans()):
        w[rows // 2] = 0  # an all-zero row
    return w


@settings(max_examples=40, deadline=None)
@given(weights(group_size=16))
def test_int8_weight_round_trip(w: torch.Tensor) -> None:
    w_q, w_scale = quantize_int8_weight(w)
    back = dequantize_int8_weight(w_q, w_scale, torch.float32)
    bound = w_scale[:, None] * 0.5 * (1 + 1e-5)
    assert ((back - w).abs() <= bound).all()
    assert (back[w.abs().amax(dim=1) == 0] == 0).all()


@settings(max_examples=40, deadline=None)
@given(weights(group_size=32))
def test_int4_codes_round_trip(w: torch.Tensor) -> None:
    codes, scale, zero = quantize_int4_codes(w, 32)
    assert int(codes.max()) <= 15
    back = dequantize_int4_codes(codes, scale, zero)
    step = scale.repeat_interleave(32, dim=1)
    slack = 1e-5 * w.abs().amax()  # fp32 rounding of zero = min + 8 * scale
    assert ((back - w).abs() <= step * 0.5 + slack).all()
    zero_groups = w.view(w.shape[0], -1, 32).abs().amax(dim=-1) == 0
    assert (back.view(w.shape[0], -1, 32)[zero_groups] == 0).all()


@settings(max_examples=40, deadline=None)
@given(weights(group_size=64))
def test_nf4_round_trip(w: torch.Tensor) -> None:
    packed, absmax = quantize_nf4(w, 64)
    back = dequantize_nf4(packed, absmax, torch.float32)
    bound = absmax.repeat_interleave(64, dim=1) * MAX_NF4_HALF_GAP * (1 + 1e-5)
    assert ((back - w).abs() <= bound).all()
    # Exact zero is a level, and each group's absmax value comes back exactly.
    assert (back[w == 0] == 0).all()
    groups, back_groups = w.view(w.shape[0], -1, 64), back.view(w.shape[0], -1, 64)
    peak = groups.abs().argmax(dim=-1, keepdim=True)
    torch.testing.assert_close(back_groups.gather(-1, peak).abs(), groups.gather(-1, peak).abs())


@settings(max_examples=40, deadline=None)
@given(weights(group_size=8), st.sampled_from([8, 16, 64]))
def test_int8_kv_round_trip(x: torch.Tensor, group_size: int) -> None:
    if x.shape[1] % group_size:
        x = torch.cat([x, torch.zeros(x.shape[0], group_size - x.shape[1] % group_size)], 1)
    q, scale = quantize_kv_int8(x, group_size, torch.float16)
    back = dequantize_kv_int8(q, scale)
    step = scale.float().repeat_interleave(group_size, dim=-1)
    absmax = x.view(x.shape[0], -1, group_size).abs().amax(dim=-1).repeat_interleave(group_size, 1)
    # fp16 rounds the scale down by up to 2^-11, so the largest code may be 127.06 -> 127,
    # and a scale below fp16's subnormal range (absmax < 7.6e-6) flushes to zero.
    bound = step * 0.5 + absmax * 2**-10 + 1e-5
    assert ((back - x).abs() <= bound).all()
    assert (back[x == 0] == 0).all()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close_to_scale(out: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """|out - expected| <= rtol x max|expected| (bf16 outputs round relative to each value,
    and sums of mixed signs make elementwise relative errors meaningless)."""
    error = (out.double() - expected).abs().max().item()
    assert error <= rtol * expected.abs().max().item(), f"max error {error}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_weight_only_gemm(dtype: torch.dtype, m: int) -> None:
    g = gen(m)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(m, 256, generator=g).to(dtype)
    w_q, w_scale = quantize_int8_weight(w)
    out = ops.int8_weight_only_gemm(x, w_q, w_scale.to(dtype))
    assert out.dtype == dtype and out.shape == (m, 96)
    exact = x.double() @ dequantize_int8_weight(w_q, w_scale.to(dtype), torch.float64).t()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        assert_close_to_scale(out, exact, 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "group_size"), [(1, 32), (7, 64), (33, 128)])
def test_int4_packed_gemm(dtype: torch.dtype, m: int, group_size: int) -> None:
    g = gen(m + group_size)
    w = torch.randn(64, 512, generator=g)
    x = torch.randn(m, 512, generator=g).to(dtype)
    codes, scale, zero = quantize_int4_codes(w, group_size)
    packed, scales_and_zeros = pack_int4_for_cpu(codes, scale, zero, dtype)
    out = ops.int4_packed_gemm(x, packed, scales_and_zeros, group_size, codes)
    assert out.dtype == dtype and out.shape == (m, 64)
    # The reference uses the scales as the kernel sees them (rounded to the activation dtype).
    s, z = scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()
    exact = x.double() @ dequantize_int4_codes(codes, s, z).double().t()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=1e-4)
    else:
        assert_close_to_scale(out, exact, 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_gemm(dtype: torch.dtype) -> None:
    g = gen(3)
    w = torch.randn(48, 256, generator=g)
    x = torch.randn(4, 256, generator=g).to(dtype)
    packed, absmax = quantize_nf4(w, 64)
    out = ops.nf4_gemm(x, packed, absmax)
    exact = x.double() @ dequantize_nf4(packed, absmax, torch.float64).t()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        assert_close_to_scale(out, exact, 2e-2)


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_weight_only_error_against_float_gemm(fmt: str) -> None:
    """Loose bounds on Gaussian weights (relative Frobenius error vs the float GEMM): they
    catch a wrong layout or scale, not grade accuracy."""
    g = gen(11)
    w = torch.randn(128, 512, generator=g)
    x = torch.randn(8, 512, generator=g)
    if fmt == "int8":
        w_q, w_scale = quantize_int8_weight(w)
        out, bound = ops.int8_weight_only_gemm(x, w_q, w_scale), 0.02
    elif fmt == "int4":
        codes, scale, zero = quantize_int4_codes(w, 32)
        packed, sz = pack_int4_for_cpu(codes, scale, zero, torch.float32)
        out, bound = ops.int4_packed_gemm(x, packed, sz, 32, codes), 0.15
    else:
        packed, absmax = quantize_nf4(w, 64)
        out, bound = ops.nf4_gemm(x, packed, absmax), 0.15
    exact = x @ w.t()
    assert float((out - exact).norm() / exact.norm()) < bound
