"""Paged KV cache writes (scatter by slot) and int8 group quantization, in torch.

Cache layout, per layer (one tensor for K, one for V):

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
            └ block_id  └ offset     slot = block_id * block_size + offset

An int8 cache carries scales beside it, one per group of KV_QUANT_GROUP_SIZE values along
head_dim: k_scale[num_blocks, block_size, num_kv_heads, head_dim // KV_QUANT_GROUP_SIZE].
The scale dtype is the caller's choice (fp16 keeps the overhead at 2 bytes per 8 values).
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_QUANT_GROUP_SIZE = 8
INT8_MAX = 127.0


def quantize_kv_int8(
    x: Tensor, group_size: int = KV_QUANT_GROUP_SIZE, scale_dtype: torch.dtype = torch.float16
) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantization with one scale per `group_size` values of the last dim.

    x [..., D] -> (q int8 [..., D], scale [..., D // group_size] in `scale_dtype`).
    The scale is rounded to `scale_dtype` *before* dividing, so dequantizing with the stored
    scale is exactly what the quantizer assumed.
    """
    d = x.shape[-1]
    assert d % group_size == 0, f"head_dim {d} is not a multiple of the group size {group_size}"
    groups = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / INT8_MAX).to(scale_dtype)
    # An all-zero group gets scale 0; divide by 1 there (the quotient is 0 anyway).
    divisor = torch.where(scale == 0, 1.0, scale.float()).unsqueeze(-1)
    q = torch.round(groups / divisor).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_kv_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of `quantize_kv_int8`: q [..., D] int8, scale [..., D // G] -> [..., D]."""
    d = q.shape[-1]
    group_size = d // scale.shape[-1]
    groups = q.reshape(*q.shape[:-1], d // group_size, group_size).float()
    return (groups * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at `slot_mapping` [T] (int64), in place.

    With an int8 cache, pass k_scale/v_scale: the tokens are quantized per group on the way in.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"k_cache {tuple(k_cache.shape)}"
    slots = slot_mapping.long()
    # index_copy_ on the [num_slots, Hkv, D] view is one memcpy per token, no Python loop.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None, "an int8 KV cache needs k/v scales"
        group_size = head_dim // k_scale.shape[-1]
        k_q, k_s = quantize_kv_int8(key, group_size, k_scale.dtype)
        v_q, v_s = quantize_kv_int8(value, group_size, v_scale.dtype)
        k_flat.index_copy_(0, slots, k_q)
        v_flat.index_copy_(0, slots, v_q)
        k_scale.view(-1, num_kv_heads, k_scale.shape[-1]).index_copy_(0, slots, k_s)
        v_scale.view(-1, num_kv_heads, v_scale.shape[-1]).index_copy_(0, slots, v_s)
        return
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))
