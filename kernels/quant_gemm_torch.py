"""Quantized linear layers in torch: W8A8 int8 GEMM and int4 weight-only GEMM.

    int8 (W8A8):  W ≈ w_q[N, K] · w_scale[N]           (per output channel, symmetric)
                  x ≈ x_q[M, K] · x_scale[M]           (per token, computed at run time)
                  y = (x_q @ w_q^T) [int32] · x_scale ⊗ w_scale
    int4 (weight-only, asymmetric, grouped along K, GGUF Q4_1's scheme):
                  W[n, k] = q[n, k] · scale[n, k // G] + min[n, k // G],  q in 0..15
                  packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4             (uint8 [N, K/2])

These are the references for the Triton kernels and the CPU path (int8 uses torch._int_mm,
which runs on CPU; int4 dequantizes to the activation dtype and calls one matmul).
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0
INT4_MAX = 15.0


def quantize_int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: x [R, K] -> (q int8 [R, K], scale fp32 [R])."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / INT8_MAX
    divisor = torch.where(scale == 0, 1.0, scale)[:, None]
    q = torch.round(x32 / divisor).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_gemm(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """W8A8: x [M, K] float, w_q [N, K] int8, w_scale [N] -> [M, N] in x.dtype.

    The activation is quantized per token on the fly; accumulation is exact int32.
    """
    assert x.shape[-1] == w_q.shape[1] and w_scale.shape == (w_q.shape[0],)
    x_q, x_scale = quantize_int8_rows(x)
    acc = torch._int_mm(x_q, w_q.t())
    out = acc.float() * x_scale[:, None] * w_scale.float()[None, :]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def quantize_int4(
    weight: Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.float16
) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (packed uint8 [N, K/2], scale [N, K/G], min [N, K/G]).

    Scale and min are rounded to `scale_dtype` before the codes are computed, so
    `dequantize_int4` reproduces what the quantizer assumed.
    """
    n, k = weight.shape
    assert k % group_size == 0 and group_size % 2 == 0, f"K {k}, group {group_size}"
    groups = weight.float().view(n, k // group_size, group_size)
    low = groups.amin(dim=-1).to(scale_dtype)
    scale = ((groups.amax(dim=-1) - low.float()) / INT4_MAX).to(scale_dtype)
    divisor = torch.where(scale == 0, 1.0, scale.float())
    q = torch.round((groups - low.float()[..., None]) / divisor[..., None]).clamp_(0, INT4_MAX)
    q = q.to(torch.uint8).view(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, low


def dequantize_int4(
    packed: Tensor, scale: Tensor, low: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of `quantize_int4` -> [N, K] in `dtype`."""
    n, half_k = packed.shape
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, 2 * half_k).float()
    group_size = 2 * half_k // scale.shape[1]
    q = q.view(n, scale.shape[1], group_size)
    w = q * scale.float()[..., None] + low.float()[..., None]
    return w.view(n, 2 * half_k).to(dtype)


def int4_gemm(
    x: Tensor, packed: Tensor, scale: Tensor, low: Tensor, bias: Tensor | None = None
) -> Tensor:
    """Weight-only int4: x [M, K] @ dequant(W)^T [K, N] -> [M, N] in x.dtype."""
    assert x.shape[-1] == 2 * packed.shape[1], f"x {tuple(x.shape)}, packed {packed.shape}"
    out = x @ dequantize_int4(packed, scale, low, x.dtype).t()
    if bias is not None:
        out += bias.to(x.dtype)
    return out
