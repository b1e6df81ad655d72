"""The C++ KV-cache write against the torch reference (bit-exact), on the SIMD kernels and the
scalar fallback."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cpu_extension_cases import (
    FLOAT_DTYPES,
    check_write,
    seeded,
)

# --- KV-cache write --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cache_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_cache_float_matches_torch(
    extension, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("write", dtype, cache_dtype, head_dim)
    check_write(extension, g, dtype, cache_dtype, None, head_dim=head_dim)


@pytest.mark.parametrize("quant_group", [8, 16, 64])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_cache_int8_is_bit_exact(
    extension, quant_group: int, dtype: torch.dtype, scale_dtype: torch.dtype, head_dim: int
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("write int8", quant_group, dtype, scale_dtype, head_dim)
    check_write(
        extension, g, dtype, torch.int8, quant_group, head_dim=head_dim, scale_dtype=scale_dtype
    )


def test_write_kv_cache_many_tokens_in_parallel(extension) -> None:  # type: ignore[no-untyped-def]
    """A prefill-sized write (enough rows for the parallel path)."""
    g = seeded("write many")
    check_write(extension, g, torch.bfloat16, torch.int8, 8, num_tokens=140)
    check_write(extension, g, torch.bfloat16, torch.bfloat16, None, num_tokens=140)


def test_int8_rounds_half_to_even(extension) -> None:  # type: ignore[no-untyped-def]
    """Codes exactly halfway between two integers: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0."""
    head_dim = 8
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])  # scale exactly 1.0
    key = row.view(1, 1, head_dim)
    k_cache = torch.zeros(1, 1, 1, head_dim, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(1, 1, 1, 1, dtype=torch.float16)
    v_scale = torch.zeros_like(k_scale)
    extension.write_kv_cache(
        key, key, k_cache, v_cache, torch.zeros(1, dtype=torch.int64), k_scale, v_scale
    )
    assert k_cache.flatten().tolist() == [127, 0, 2, 2, 0, -2, -2, 4]
    assert k_scale.item() == 1.0


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "quant_group"),
    [
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.float16, None),
        (torch.float32, torch.int8, 8),
        (torch.bfloat16, torch.int8, 64),
    ],
)
def test_scalar_fallback_write(
    extension,
    scalar_kernels: None,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    quant_group: int | None,
) -> None:  # type: ignore[no-untyped-def]
    check_write(
        extension, seeded("scalar write", dtype, cache_dtype), dtype, cache_dtype, quant_group
    )
