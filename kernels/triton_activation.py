"""Gated activations in Triton on a fused [gate | up] row, fp32 math: silu(gate) * up
(SwiGLU) and gelu_tanh(gate) * up (GeGLU, Gemma)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gated_activation_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_x,
    stride_o,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 x (1 + tanh(z)) = x * sigmoid(2 z), z = sqrt(2 / pi) (x + 0.044715 x^3)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = gate * tl.sigmoid(2.0 * inner) * up
    else:
        out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor, *, block: int = 1024) -> Tensor:
    """Same contract as `kernels.activation_torch.silu_and_mul`."""
    return _gated(x, block, gelu_tanh=False)


def gelu_tanh_and_mul(x: Tensor, *, block: int = 1024) -> Tensor:
    """Same contract as `kernels.activation_torch.gelu_tanh_and_mul`."""
    return _gated(x, block, gelu_tanh=True)


def _gated(x: Tensor, block: int, *, gelu_tanh: bool) -> Tensor:
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1, f"x {tuple(x.shape)}"
    intermediate = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2d.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0:
        grid = (x2d.shape[0], triton.cdiv(intermediate, block))
        _gated_activation_kernel[grid](
            x2d,
            out,
            x2d.stride(0),
            out.stride(0),
            INTERMEDIATE=intermediate,
            BLOCK=block,
            GELU_TANH=gelu_tanh,
        )
    return out.view(*x.shape[:-1], intermediate)
