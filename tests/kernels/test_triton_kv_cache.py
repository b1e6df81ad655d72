"""Triton KV cache write (interpreter) vs the torch op: bit-exact, float and int8 caches."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_cache_torch, triton_kv_cache

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "num_kv_heads", "head_dim"), [(1, 1, 64), (21, 3, 128)])
@pytest.mark.parametrize("quantized", [False, True])
def test_write_kv_cache(
    dtype: torch.dtype, num_tokens: int, num_kv_heads: int, head_dim: int, quantized: bool
) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    num_blocks = 3
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    cache_dtype = torch.int8 if quantized else dtype
    # Caches start as garbage; the slots we do not write must keep it.
    caches = [torch.randint(-100, 100, shape, generator=g).to(cache_dtype) for _ in range(2)]
    scales = [None, None]
    if quantized:
        scale_shape = (*shape[:3], head_dim // kv_cache_torch.KV_QUANT_GROUP_SIZE)
        scales = [torch.rand(scale_shape, generator=g).half() for _ in range(2)]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    key[0, 0, :8] = 0  # an all-zero quantization group
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    expected_caches = [c.clone() for c in caches]
    expected_scales = [s.clone() if s is not None else None for s in scales]
    kv_cache_torch.write_kv_cache(key, value, *expected_caches, slots, *expected_scales)
    triton_kv_cache.write_kv_cache(key, value, *caches, slots, *scales)
    for got, want in zip(caches + scales, expected_caches + expected_scales, strict=True):
        if want is not None:
            assert torch.equal(got, want)


def test_write_kv_cache_strided_inputs() -> None:
    """key/value as views of a fused [T, Hq + 2 Hkv, D] projection, as the model has them."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, 4 + 2 * 2, 64, generator=g)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.zeros(2, BLOCK_SIZE, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 0, 31, 8])
    triton_kv_cache.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1)[slots], key)
    assert torch.equal(v_cache.flatten(0, 1)[slots], value)
