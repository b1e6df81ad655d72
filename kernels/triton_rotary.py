"""Rotary position embedding (NeoX / Hugging Face rotate_half) in Triton, in place.

One program per token rotates all of its query and key heads, so the token's cos/sin row is
read once. Pairs are (i, i + R/2), R the width of the cos|sin table (R = D, or R < D for
partial rotary: the last D - R dims of each head are neither read nor written):
out_lo = x_lo cos - x_hi sin, out_hi = x_hi cos + x_lo sin.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    lo_ptr = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x_lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    out_lo = x_lo * cos[None, :] - x_hi * sin[None, :]
    out_hi = x_hi * cos[None, :] + x_lo * sin[None, :]
    tl.store(lo_ptr, out_lo.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptr + HALF, out_hi.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,  # [T, Hq, D], any token/head strides
    key_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, R]: cos | sin
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(
        tl.float32
    )
    _rotate_heads(
        query_ptr + token * stride_qt,
        stride_qh,
        cos,
        sin,
        NUM_Q_HEADS,
        BLOCK_Q_HEADS,
        HALF,
        BLOCK_HALF,
    )
    _rotate_heads(
        key_ptr + token * stride_kt,
        stride_kh,
        cos,
        sin,
        NUM_KV_HEADS,
        BLOCK_KV_HEADS,
        HALF,
        BLOCK_HALF,
    )


def apply_rotary(
    query: Tensor, key: Tensor, positions: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """Same contract as `kernels.rotary_torch.apply_rotary` (rotates in place)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == (num_tokens, num_kv_heads, head_dim), f"key {tuple(key.shape)}"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim <= head_dim and rotary_dim % 2 == 0, f"cos_sin_cache {cos_sin_cache.shape}"
    assert query.stride(2) == 1 and key.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    if num_tokens == 0:
        return query, key
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return query, key
