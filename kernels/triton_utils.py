"""Small @triton.jit helpers shared by several kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(x):
    """Rounds fp32 to the nearest integer, ties to even (torch.round's rule)."""
    rounded = tl.floor(x + 0.5)
    # floor(x + 0.5) rounds ties up; a tie that landed on an odd integer goes down instead.
    is_tie = (rounded - x) == 0.5
    is_odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0
    return tl.where(is_tie & is_odd, rounded - 1.0, rounded)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap) in fp32 (Gemma 2's attention logit soft-capping).

    tanh is built from exp (the interpreter has no libdevice): x + x^3 Q(x^2) below
    |x| = 0.625 (Cephes tanhf), 1 - 2 / (exp(2|x|) + 1) with x's sign above, so neither
    side cancels; |x| is clamped at 20, where tanh is 1 in fp32, to keep exp finite.
    """
    x = scores / cap
    ax = tl.abs(x)
    z = x * x
    q = -5.70498872745e-3 * z + 2.06390887954e-2
    q = q * z - 5.37397155531e-2
    q = q * z + 1.33314422036e-1
    q = q * z - 3.33332819422e-1
    small = x + x * z * q
    large = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(ax, 20.0)) + 1.0)
    large = tl.where(x < 0, -large, large)
    return cap * tl.where(ax < 0.625, small, large)


@triton.jit
def dequantize_kv_tile(
    codes,
    scale_ptr,
    block_ids,
    in_block,
    stride_block,
    stride_offset,
    head_offset,
    offs_d,
    mask,
    QUANT_GROUP: tl.constexpr,
):
    """An int8 KV tile [N, D] (token n at offset in_block[n] of page block_ids[n]) times its
    per-group scales -> fp32; the scales are [pages, page size, Hkv, D // QUANT_GROUP]."""
    scales = tl.load(
        scale_ptr
        + block_ids[:, None] * stride_block
        + in_block[:, None] * stride_offset
        + head_offset
        + offs_d[None, :] // QUANT_GROUP,
        mask=mask,
        other=0.0,
    )
    return codes.to(tl.float32) * scales.to(tl.float32)
