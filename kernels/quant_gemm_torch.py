"""W8A8 int8 GEMM in torch:

    W ≈ w_q[N, K] · w_scale[N]           (per output channel, symmetric)
    x ≈ x_q[M, K] · x_scale[M]           (per token, computed at run time)
    y = (x_q @ w_q^T) [int32] · x_scale ⊗ w_scale

The reference for the Triton kernel and the CPU path (torch._int_mm runs on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0


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
