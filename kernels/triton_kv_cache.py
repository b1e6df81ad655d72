"""Paged KV cache write (scatter by slot) in Triton, with optional int8 group quantization.

One program per (token, KV head) writes that head's K and V rows to
cache[slot // block_size, slot % block_size, head]. The int8 path quantizes exactly as
`kernels.kv_cache_torch.quantize_kv_int8` does (symmetric, one scale per QUANT_GROUP values,
scale rounded to the scale dtype before dividing, round half to even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import round_half_even


@triton.jit
def _quantize_store(
    x,  # [BLOCK_D] fp32
    cache_ptr,
    scale_ptr,
    scale_offset,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
):
    groups = tl.reshape(x, (BLOCK_D // QUANT_GROUP, QUANT_GROUP))
    scale = (tl.max(tl.abs(groups), axis=1) / 127.0).to(scale_ptr.dtype.element_ty)
    scale32 = scale.to(tl.float32)
    divisor = tl.where(scale32 == 0.0, 1.0, scale32)
    codes = round_half_even(groups / divisor[:, None])
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(cache_ptr + offs_d, tl.reshape(codes, (BLOCK_D,)), mask=offs_d < HEAD_DIM)
    offs_g = tl.arange(0, BLOCK_D // QUANT_GROUP)
    tl.store(scale_ptr + scale_offset + offs_g, scale, mask=offs_g < HEAD_DIM // QUANT_GROUP)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv, D // QUANT_GROUP] when IS_INT8
    v_scale_ptr,
    slot_mapping_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_ksb,
    stride_kso,
    stride_ksh,
    stride_vsb,
    stride_vso,
    stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_INT8: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + offs_d, mask=d_mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + offs_d, mask=d_mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + head * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + head * stride_vch
    if IS_INT8:
        k_scale_offset = block * stride_ksb + offset * stride_kso + head * stride_ksh
        v_scale_offset = block * stride_vsb + offset * stride_vso + head * stride_vsh
        _quantize_store(
            k.to(tl.float32), k_dst, k_scale_ptr, k_scale_offset, HEAD_DIM, BLOCK_D, QUANT_GROUP
        )
        _quantize_store(
            v.to(tl.float32), v_dst, v_scale_ptr, v_scale_offset, HEAD_DIM, BLOCK_D, QUANT_GROUP
        )
    else:
        tl.store(k_dst + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_dst + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Same contract as `kernels.kv_cache_torch.write_kv_cache`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"k_cache {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if num_tokens == 0:
        return
    is_int8 = k_cache.dtype == torch.int8
    block_d = triton.next_power_of_2(head_dim)
    if is_int8:
        assert k_scale is not None and v_scale is not None, "an int8 KV cache needs k/v scales"
        assert k_scale.shape[:3] == k_cache.shape[:3] and v_scale.shape == k_scale.shape
        assert k_scale.stride(3) == 1 and v_scale.stride(3) == 1
        quant_group = head_dim // k_scale.shape[3]
        assert quant_group * k_scale.shape[3] == head_dim and block_d % quant_group == 0
    else:
        k_scale = v_scale = k_cache  # unused placeholders
        quant_group = 1
    _write_kv_cache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *k_scale.stride()[:3],
        *v_scale.stride()[:3],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_D=block_d,
        IS_INT8=is_int8,
        QUANT_GROUP=quant_group,
    )
