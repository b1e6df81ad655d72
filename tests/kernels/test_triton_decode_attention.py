"""Triton paged decode attention (interpreter) vs the torch op.

Tolerances: fp32 atol = rtol = 1e-5; fp16 atol = rtol = 2e-3 (inputs are fp16 in both, the
kernel accumulates in fp32, the torch path in fp32 inside SDPA; the output is rounded to fp16).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import attention_torch, triton_decode_attention
from tests.kernels.paged_kv_factory import make_paged_kv

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
BLOCK_SIZE = 16


def run_case(
    lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    partition_size: int,
    quantized: bool = False,
    seed: int = 0,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, g, quantized)
    query = (torch.randn(len(lens), num_q_heads, head_dim, generator=g) * 2).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, scale, kv.k_scale, kv.v_scale)
    features = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    expected = attention_torch.paged_decode_attention(*args, **features)
    out = triton_decode_attention.paged_decode_attention(
        *args, partition_size=partition_size, **features
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("lens", "num_q_heads", "num_kv_heads", "head_dim"),
    [
        ([1], 2, 2, 64),  # one token, MHA
        ([37], 3, 1, 128),  # partial last block, MQA with G = 3
        ([5, 16, 33], 16, 2, 64),  # many sequences, G = 8
    ],
)
def test_single_split(
    lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    run_case(lens, num_q_heads, num_kv_heads, head_dim, dtype, partition_size=512)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(3, 1, 64), (8, 8, 128)])
def test_split_k(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    # Partitions of 32 tokens: 1 (len 20), 3 (len 70, last partial) and 4 (exactly 128) splits,
    # so the merge sees unwritten split slots for the shorter sequences.
    run_case([20, 70, 128], num_q_heads, num_kv_heads, head_dim, dtype, partition_size=32)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("partition_size", [32, 512])
def test_int8_kv(partition_size: int) -> None:
    run_case([9, 45], 6, 2, 64, torch.float32, partition_size, quantized=True, seed=3)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sliding_window", [1, 16, 45, 200])
def test_sliding_window(sliding_window: int, dtype: torch.dtype) -> None:
    # Partitions of 32 tokens starting at each window: a window of 45 takes 2 splits, one of
    # 200 covers every context (up to 4 splits), one of 1 a single token.
    run_case(
        [20, 70, 128, 5], 6, 2, 64, dtype, partition_size=32, seed=4, sliding_window=sliding_window
    )


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("partition_size", [32, 512])
@pytest.mark.parametrize("sliding_window", [0, 24])
def test_logit_softcap(partition_size: int, sliding_window: int) -> None:
    run_case(
        [9, 70, 33],
        8,
        1,
        64,
        torch.float32,
        partition_size,
        seed=5,
        sliding_window=sliding_window,
        logit_softcap=2.0,
    )


@pytest.mark.usefixtures("poisoned")
def test_sliding_window_int8_kv_fp16() -> None:
    run_case(
        [9, 45, 100],
        6,
        2,
        64,
        torch.float16,
        32,
        quantized=True,
        seed=6,
        sliding_window=40,
        logit_softcap=3.0,
    )
