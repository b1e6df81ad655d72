"""Triton varlen prefill attention (interpreter) vs the torch op.

Tolerances: fp32 atol = rtol = 1e-5; fp16 atol = rtol = 2e-3 (fp16 inputs, fp32 accumulation,
fp16 output). Tiles of 16 so that short test sequences still cross tile boundaries.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import attention_torch, triton_prefill_attention
from tests.kernels.paged_kv_factory import make_paged_kv

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
BLOCK_SIZE = 16


def run_case(
    new_lens: list[int],
    prefix_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    quantized: bool = False,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> None:
    g = torch.Generator().manual_seed(sum(new_lens) + head_dim + sliding_window)
    kv = make_paged_kv(prefix_lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, g, quantized)
    total = sum(new_lens)
    query = (torch.randn(total, num_q_heads, head_dim, generator=g) * 2).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, key, value, kv.k_cache, kv.v_cache, cu, kv.lens, kv.block_tables)
    scale = 1 / math.sqrt(head_dim)
    features = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    expected = attention_torch.prefill_attention(*args, scale, kv.k_scale, kv.v_scale, **features)
    out = triton_prefill_attention.prefill_attention(
        *args, scale, kv.k_scale, kv.v_scale, block_m=16, block_n=16, **features
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("new_lens", "prefix_lens", "num_q_heads", "num_kv_heads", "head_dim"),
    [
        ([1], [0], 1, 1, 64),  # one token, nothing cached
        ([23], [0], 3, 1, 128),  # crosses a tile boundary, G = 3
        ([5], [37], 2, 2, 64),  # prefix hit: partial last cached block
        ([17, 1, 9], [0, 20, 16], 8, 1, 64),  # mixed batch, G = 8
    ],
)
def test_prefill_attention(
    new_lens: list[int],
    prefix_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    run_case(new_lens, prefix_lens, num_q_heads, num_kv_heads, head_dim, dtype)


@pytest.mark.usefixtures("poisoned")
def test_prefill_attention_int8_prefix() -> None:
    run_case([6, 3], [19, 0], 4, 2, 64, torch.float32, quantized=True)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("new_lens", "prefix_lens", "sliding_window"),
    [
        ([23], [0], 5),  # no prefix; tiles of 16 skip the new keys before the window
        ([5], [37], 8),  # the cached prefix is longer than the window
        ([40, 1, 9], [3, 50, 16], 20),  # mixed batch, windows crossing block boundaries
        ([6], [10], 64),  # the window covers everything
        ([9], [30], 1),  # each token sees itself only
    ],
)
def test_sliding_window(
    new_lens: list[int], prefix_lens: list[int], sliding_window: int, dtype: torch.dtype
) -> None:
    run_case(new_lens, prefix_lens, 6, 2, 64, dtype, sliding_window=sliding_window)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("sliding_window", [0, 12])
def test_logit_softcap(sliding_window: int) -> None:
    run_case(
        [17, 1, 9],
        [0, 20, 16],
        8,
        1,
        64,
        torch.float32,
        sliding_window=sliding_window,
        logit_softcap=2.0,
    )


@pytest.mark.usefixtures("poisoned")
def test_sliding_window_int8_prefix() -> None:
    run_case([6, 3], [40, 19], 4, 2, 64, torch.float32, True, sliding_window=10, logit_softcap=3.0)
