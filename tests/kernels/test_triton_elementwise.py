"""Triton RMSNorm, fused add + RMSNorm, rotary and SiLU-and-mul (interpreter) vs the torch ops.

Tolerances: fp32 atol = rtol = 1e-5; fp16 atol = rtol = 2e-3 (both compute in fp32 and round
once to fp16, so differences are one fp16 ulp at most).
"""

from __future__ import annotations

import pytest
import torch

from kernels import (
    activation_torch,
    norm_torch,
    rotary_torch,
    triton_activation,
    triton_norm,
    triton_rotary,
)

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
DTYPES = [torch.float32, torch.float16]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (2, 3, 128)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = gen(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    expected = norm_torch.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(triton_norm.rms_norm(x, weight, 1e-6), expected, **TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_fused_add_rms_norm(dtype: torch.dtype, num_tokens: int) -> None:
    g = gen(num_tokens)
    x = torch.randn(num_tokens, 320, generator=g).to(dtype)
    residual = torch.randn(num_tokens, 320, generator=g).to(dtype)
    weight = torch.randn(320, generator=g).to(dtype)
    normed, summed = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = norm_torch.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, expected_summed, **TOLERANCES[dtype])
    torch.testing.assert_close(normed, expected_normed, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"),
    # Whole heads, then partial rotary: (128, 96) is Phi-4-mini's factor 0.75.
    [(64, 64), (128, 128), (128, 96), (64, 16), (80, 78)],
)
@pytest.mark.parametrize(("num_tokens", "num_q_heads", "num_kv_heads"), [(1, 3, 1), (6, 8, 8)])
def test_apply_rotary(
    dtype: torch.dtype,
    head_dim: int,
    rotary_dim: int,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
) -> None:
    g = gen(head_dim + rotary_dim + num_tokens)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim)
    angles = torch.arange(256)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 256, (num_tokens,), generator=g)
    # Views of one fused qkv output; the V slice and the dims past rotary_dim must come out
    # untouched (the torch op is checked for that against a formula in test_torch_ops.py).
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    expected_qkv = qkv.clone()
    split = (num_q_heads, num_q_heads + num_kv_heads)
    rotary_torch.apply_rotary(
        expected_qkv[:, : split[0]], expected_qkv[:, split[0] : split[1]], positions, cache
    )
    q, _ = triton_rotary.apply_rotary(
        qkv[:, : split[0]], qkv[:, split[0] : split[1]], positions, cache
    )
    assert q.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(qkv, expected_qkv, **TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (3, 2 * 1536)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=gen(shape[0])) * 3).to(dtype)
    expected = activation_torch.silu_and_mul(x)
    out = triton_activation.silu_and_mul(x, block=512)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (3, 2 * 1536)])
def test_gelu_tanh_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=gen(shape[0] + 7)) * 3).to(dtype)
    expected = activation_torch.gelu_tanh_and_mul(x)
    out = triton_activation.gelu_tanh_and_mul(x, block=512)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
