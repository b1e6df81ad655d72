"""W8A8 GEMM: the torch op against an exact fp64 reference, then the Triton kernel
(interpreter) against the torch op.

Tolerances: torch vs fp64 of the same int codes: rtol = atol = 1e-5 (int32 accumulation is
exact; only the fp32 epilogue rounds). Triton vs torch: fp32 1e-5; fp16 atol = rtol = 2e-3.
Quantization error vs the float GEMM is checked loosely (relative Frobenius 5% on Gaussian
weights) to catch format bugs, not to grade accuracy.
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
