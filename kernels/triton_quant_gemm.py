"""W8A8 int8 GEMM in Triton (int32 accumulation).

Same contract and format as `kernels.quant_gemm_torch` (see its docstring). Two kernels:
per-token activation quantization (one program per row), then an int8 x int8 -> int32 GEMM
with the two scales applied in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import round_half_even


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] float
    q_ptr,  # [M, K] int8
    scale_ptr,  # [M] fp32
    stride_x,
    stride_q,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = 0.0
    for start in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=start + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    scale = amax / 127.0
    divisor = tl.where(scale == 0.0, 1.0, scale)
    for start in range(0, K, BLOCK_K):
        mask = start + offs < K
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(round_half_even(x / divisor), -127.0), 127.0)
        tl.store(q_ptr + row * stride_q + start + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _int8_gemm_kernel(
    a_ptr,  # [M, K] int8 (quantized activations)
    b_ptr,  # [N, K] int8 (weights)
    a_scale_ptr,  # [M] fp32
    b_scale_ptr,  # [N]
    bias_ptr,  # [N] when HAS_BIAS
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        k_mask = start + offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * stride_am + start + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0,
        )
        b = tl.load(
            b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + start + offs_k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0,
        )
        acc += tl.dot(a, b, out_dtype=tl.int32)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int8_gemm(
    x: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    block_m: int = 32,
    block_n: int = 64,
    block_k: int = 64,
) -> Tensor:
    """Same contract as `kernels.quant_gemm_torch.int8_gemm`."""
    m, k = x.shape
    n = w_q.shape[0]
    assert w_q.shape == (n, k) and w_q.dtype == torch.int8, f"w_q {tuple(w_q.shape)}"
    assert w_scale.shape == (n,) and (bias is None or bias.shape == (n,))
    assert x.stride(1) == 1 and w_q.stride(1) == 1
    x_q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    x_scale = torch.empty(m, dtype=torch.float32, device=x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _quantize_rows_kernel[(m,)](
        x,
        x_q,
        x_scale,
        x.stride(0),
        x_q.stride(0),
        K=k,
        BLOCK_K=min(4096, triton.next_power_of_2(k)),
    )
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](
        x_q,
        w_q,
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        m,
        n,
        k,
        x_q.stride(0),
        w_q.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
