"""Quantized GEMMs: the torch ops against exact fp64 references, then the Triton kernels
(interpreter) against the torch ops.

Tolerances: int8 GEMM torch vs fp64 of the same int codes: rtol = atol = 1e-5 (int32
accumulation is exact; only the fp32 epilogue rounds). Triton vs torch: fp32 1e-5; fp16
atol = rtol = 2e-3. int4: torch vs fp64 of the dequantized weight 1e-4 (fp32 matmul over
K = 256). Quantization error vs the float GEMM is checked loosely (relative Frobenius 5% for
int8, 15% for int4 on Gaussian weights) to catch format bugs, not to grade accuracy.
"""

from __future__ import annotations

import pytest
import torch

from kernels import quant_gemm_torch, triton_quant_gemm

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m", [1, 7])
def test_int8_gemm_torch(m: int) -> None:
    g = gen(m)
    x = torch.randn(m, 256, generator=g)
    weight = torch.randn(48, 256, generator=g)
    bias = torch.randn(48, generator=g)
    w_q, w_scale = quant_gemm_torch.quantize_int8_rows(weight)
    out = quant_gemm_torch.int8_gemm(x, w_q, w_scale, bias)
    x_q, x_scale = quant_gemm_torch.quantize_int8_rows(x)
    exact = (x_q.double() @ w_q.double().t()) * x_scale.double()[:, None] * w_scale.double()
    torch.testing.assert_close(out.double(), exact + bias.double(), atol=1e-5, rtol=1e-5)
    assert rel_error(out - bias, x @ weight.t()) < 0.05


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_and_gemm_torch(group_size: int) -> None:
    g = gen(group_size)
    weight = torch.randn(40, 256, generator=g)
    packed, scale, low = quant_gemm_torch.quantize_int4(weight, group_size)
    assert packed.shape == (40, 128) and scale.shape == (40, 256 // group_size)
    w = quant_gemm_torch.dequantize_int4(packed, scale, low)
    step = scale.float().repeat_interleave(group_size, dim=1)
    assert ((w - weight).abs() <= step * 0.5 + 2e-3 * weight.abs().amax()).all()
    x = torch.randn(3, 256, generator=g)
    out = quant_gemm_torch.int4_gemm(x, packed, scale, low)
    torch.testing.assert_close(out.double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-4)
    assert rel_error(out, x @ weight.t()) < 0.15


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "with_bias"), [(1, False), (19, True)])
def test_int8_gemm_triton(dtype: torch.dtype, m: int, with_bias: bool) -> None:
    g = gen(m + 100)
    x = torch.randn(m, 160, generator=g).to(dtype)  # K not a multiple of BLOCK_K
    w_q, w_scale = quant_gemm_torch.quantize_int8_rows(torch.randn(40, 160, generator=g))
    bias = torch.randn(40, generator=g).to(dtype) if with_bias else None
    expected = quant_gemm_torch.int8_gemm(x, w_q, w_scale, bias)
    out = triton_quant_gemm.int8_gemm(x, w_q, w_scale, bias, block_m=16, block_n=32, block_k=64)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "group_size", "with_bias"), [(1, 32, False), (18, 64, True)])
def test_int4_gemm_triton(dtype: torch.dtype, m: int, group_size: int, with_bias: bool) -> None:
    g = gen(m + group_size)
    x = torch.randn(m, 192, generator=g).to(dtype)
    packed, scale, low = quant_gemm_torch.quantize_int4(
        torch.randn(40, 192, generator=g), group_size
    )
    bias = torch.randn(40, generator=g).to(dtype) if with_bias else None
    expected = quant_gemm_torch.int4_gemm(x, packed, scale, low, bias)
    out = triton_quant_gemm.int4_gemm(
        x, packed, scale, low, bias, block_m=16, block_n=32, block_k=64
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
