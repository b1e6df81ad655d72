"""The torch ops (CPU path and oracle) against naive fp64 references written here.

Tolerances: fp32 atol = rtol = 1e-5 (attention: 2e-5); bf16 atol = rtol = 2e-2 (an 8-bit
mantissa rounds each stored value by up to 2^-9 relative; outputs are O(1)).
int8 KV: checked against the reference on the *dequantized* cache, with fp32 tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import attention_torch, backend, ops
from kernels.kv_cache_torch import KV_QUANT_GROUP_SIZE, dequantize_kv_int8, quantize_kv_int8
from tests.kernels.paged_kv_factory import make_paged_kv, masked_ref_attention, ref_attention

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
ATTN_TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "torch")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- backend selection ------------------------------------------------------------------------


def test_backend_rule_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1)
    monkeypatch.delenv(backend.BACKEND_ENV_VAR)
    assert backend.backend_for(x) == "torch"
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "TRITON")
    assert backend.backend_for(x) == "triton"
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=backend.BACKEND_ENV_VAR):
        backend.backend_for(x)


# --- KV cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_write_kv_cache(dtype: torch.dtype, num_tokens: int) -> None:
    g = gen(num_tokens)
    num_blocks, hkv, d = 5, 2, 64
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(num_tokens, hkv, d, generator=g).to(dtype)
    value = torch.randn(num_tokens, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = k_before.flatten(0, 1), v_before.flatten(0, 1)
    for t, slot in enumerate(slots.tolist()):
        expected_k[slot] = key[t]
        expected_v[slot] = value[t]
    assert torch.equal(k_cache.flatten(0, 1), expected_k)
    assert torch.equal(v_cache.flatten(0, 1), expected_v)


def test_quantize_kv_int8_round_trip() -> None:
    x = torch.randn(7, 3, 64, generator=gen(1)) * 3
    x[0, 0, :KV_QUANT_GROUP_SIZE] = 0  # an all-zero group must not divide by zero
    q, scale = quantize_kv_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (7, 3, 64 // KV_QUANT_GROUP_SIZE)
    restored = dequantize_kv_int8(q, scale)
    assert torch.equal(restored[0, 0, :KV_QUANT_GROUP_SIZE], torch.zeros(KV_QUANT_GROUP_SIZE))
    # Error is at most half a step, plus fp16 rounding of the scale times the largest code.
    step = scale.float().repeat_interleave(KV_QUANT_GROUP_SIZE, dim=-1)
    assert ((restored - x).abs() <= step * 0.5 + step * 127 * 2**-10 + 1e-7).all()


def test_write_kv_cache_int8() -> None:
    g = gen(3)
    num_blocks, hkv, d, num_tokens = 4, 2, 64, 21
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d // 8, dtype=torch.float16)
    v_scale = torch.zeros_like(k_scale)
    key = torch.randn(num_tokens, hkv, d, generator=g)
    value = torch.randn(num_tokens, hkv, d, generator=g)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    ops.write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for cache, scale, src in ((k_cache, k_scale, key), (v_cache, v_scale, value)):
        q_expected, s_expected = quantize_kv_int8(src)
        assert torch.equal(cache.flatten(0, 1)[slots], q_expected)
        assert torch.equal(scale.flatten(0, 1)[slots], s_expected)


# --- decode attention ---------------------------------------------------------------------------

DECODE_LENS = {
    "one_token": [1],
    "one_seq_partial_block": [37],
    "many_seqs": [1, 16, 17, 50, 3],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("lens_name", list(DECODE_LENS))
def test_paged_decode_attention(
    dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, lens_name: str
) -> None:
    lens = DECODE_LENS[lens_name]
    g = gen(len(lens) * head_dim + num_q_heads)
    kv = make_paged_kv(lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, g)
    query = torch.randn(len(lens), num_q_heads, head_dim, generator=g).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    for b, n in enumerate(lens):
        k, v = kv.dense_kv(b)
        expected = ref_attention(query[b : b + 1], k, v, scale, q_offset=n - 1)
        torch.testing.assert_close(out[b : b + 1].double(), expected, **ATTN_TOLERANCES[dtype])


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2)])
def test_paged_decode_attention_int8_kv(num_q_heads: int, num_kv_heads: int) -> None:
    lens = [5, 33, 16]
    g = gen(11)
    kv = make_paged_kv(lens, num_kv_heads, 64, BLOCK_SIZE, torch.float32, g, quantized=True)
    query = torch.randn(len(lens), num_q_heads, 64, generator=g)
    out = ops.paged_decode_attention(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125, kv.k_scale, kv.v_scale
    )
    for b, n in enumerate(lens):
        k, v = kv.dense_kv(b)
        expected = ref_attention(query[b : b + 1], k, v, 0.125, q_offset=n - 1)
        torch.testing.assert_close(
            out[b : b + 1].double(), expected, **ATTN_TOLERANCES[torch.float32]
        )


# --- prefill attention --------------------------------------------------------------------------

PREFILL_CASES = {
    # name: (new tokens per sequence, prefix tokens per sequence)
    "one_token_no_prefix": ([1], [0]),
    "one_seq_no_prefix": ([23], [0]),
    "one_seq_prefix": ([9], [21]),
    "many_mixed": ([1, 17, 5, 16], [0, 16, 3, 0]),
    "decode_like_with_prefix": ([1, 1], [40, 7]),
    # Several fresh prompts go through one batched SDPA call: equal lengths as a view,
    # unequal ones padded with a key-length mask, mixed with prefix sequences around them.
    "batched_equal": ([12, 12, 12], [0, 0, 0]),
    "batched_unequal": ([10, 13, 12, 9], [0, 0, 0, 0]),
    "batched_between_prefixes": ([5, 11, 11, 3, 10], [7, 0, 0, 20, 0]),
}


def run_prefill_case(
    new_lens: list[int],
    prefix_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    quantized: bool = False,
) -> None:
    g = gen(seed)
    kv = make_paged_kv(prefix_lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, g, quantized)
    total = sum(new_lens)
    query = torch.randn(total, num_q_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = ops.prefill_attention(
        query,
        key,
        value,
        kv.k_cache,
        kv.v_cache,
        cu,
        kv.lens,
        kv.block_tables,
        scale,
        kv.k_scale,
        kv.v_scale,
    )
    assert out.dtype == dtype and out.shape == query.shape
    for s, prefix in enumerate(prefix_lens):
        lo, hi = int(cu[s]), int(cu[s + 1])
        k_prefix, v_prefix = kv.dense_kv(s)
        k = torch.cat([k_prefix, key[lo:hi].double()])
        v = torch.cat([v_prefix, value[lo:hi].double()])
        expected = ref_attention(query[lo:hi], k, v, scale, q_offset=prefix)
        torch.testing.assert_close(out[lo:hi].double(), expected, **ATTN_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention(
    dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, case: str
) -> None:
    new_lens, prefix_lens = PREFILL_CASES[case]
    run_prefill_case(
        new_lens, prefix_lens, num_q_heads, num_kv_heads, head_dim, dtype, seed=head_dim
    )


def test_prefill_attention_int8_kv() -> None:
    run_prefill_case([4, 9], [19, 0], 6, 2, 64, torch.float32, seed=5, quantized=True)


# --- sliding window and soft-capped logits -------------------------------------------------------
# Windows of one token, inside a block, across block boundaries (block size 16), and at least
# as long as every context; each case also checks that the feature changes the result, so a
# kernel ignoring it fails.

WINDOW_DECODE_LENS = [1, 5, 16, 17, 40, 100, 33]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("sliding_window", [1, 7, 16, 33, 200])
def test_paged_decode_attention_sliding_window(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, sliding_window: int
) -> None:
    lens = WINDOW_DECODE_LENS
    g = gen(sliding_window + num_q_heads)
    kv = make_paged_kv(lens, num_kv_heads, 64, BLOCK_SIZE, dtype, g)
    query = torch.randn(len(lens), num_q_heads, 64, generator=g).to(dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125)
    out = attention_torch.paged_decode_attention(*args, sliding_window=sliding_window)
    for b, n in enumerate(lens):
        k, v = kv.dense_kv(b)
        expected = masked_ref_attention(query[b : b + 1], k, v, 0.125, n - 1, sliding_window)
        torch.testing.assert_close(out[b : b + 1].double(), expected, **ATTN_TOLERANCES[dtype])
    # batch_invariant (one call per row) and batch 1 (no mask) agree with the masked batch.
    per_row = attention_torch.paged_decode_attention(
        *args, batch_invariant=True, sliding_window=sliding_window
    )
    torch.testing.assert_close(per_row, out, **ATTN_TOLERANCES[dtype])
    full = attention_torch.paged_decode_attention(*args)
    assert (sliding_window >= max(lens)) == torch.equal(full, out)


def test_paged_decode_attention_sliding_window_equal_lengths() -> None:
    """One length for the whole batch takes the unmasked path: the window is a cut there."""
    g = gen(77)
    lens = [45, 45, 45]
    kv = make_paged_kv(lens, 2, 64, BLOCK_SIZE, torch.float32, g)
    query = torch.randn(3, 6, 64, generator=g)
    out = attention_torch.paged_decode_attention(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125, sliding_window=20
    )
    for b in range(3):
        k, v = kv.dense_kv(b)
        expected = masked_ref_attention(query[b : b + 1], k, v, 0.125, 44, sliding_window=20)
        torch.testing.assert_close(
            out[b : b + 1].double(), expected, **ATTN_TOLERANCES[torch.float32]
        )


def test_paged_decode_attention_window_skips_blocks_before_it() -> None:
    """Block-table entries before every row's window are never read (a serving engine may
    free those blocks): ids outside the cache there must not matter."""
    g = gen(78)
    lens = [70, 50]
    kv = make_paged_kv(lens, 2, 64, BLOCK_SIZE, torch.float32, g)
    query = torch.randn(2, 2, 64, generator=g)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables.clone(), kv.lens, 0.125)
    want = attention_torch.paged_decode_attention(*args, sliding_window=16)
    args[3][0, :3] = 10_000  # row 0's window starts at 54: blocks 0-2 are before it
    args[3][1, :2] = 10_000  # row 1's at 34: blocks 0-1
    assert torch.equal(attention_torch.paged_decode_attention(*args, sliding_window=16), want)


@pytest.mark.parametrize("sliding_window", [0, 10])
def test_paged_decode_attention_sliding_window_int8_kv(sliding_window: int) -> None:
    lens = [5, 33, 64, 17]
    g = gen(12)
    kv = make_paged_kv(lens, 2, 64, BLOCK_SIZE, torch.float32, g, quantized=True)
    query = torch.randn(len(lens), 6, 64, generator=g)
    out = attention_torch.paged_decode_attention(
        query,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        kv.lens,
        0.125,
        kv.k_scale,
        kv.v_scale,
        sliding_window=sliding_window,
        logit_softcap=4.0,
    )
    for b, n in enumerate(lens):
        k, v = kv.dense_kv(b)
        expected = masked_ref_attention(query[b : b + 1], k, v, 0.125, n - 1, sliding_window, 4.0)
        torch.testing.assert_close(
            out[b : b + 1].double(), expected, **ATTN_TOLERANCES[torch.float32]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("sliding_window", [0, 9])
def test_paged_decode_attention_logit_softcap(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, sliding_window: int
) -> None:
    lens = [1, 20, 37, 16]
    g = gen(num_q_heads + sliding_window)
    kv = make_paged_kv(lens, num_kv_heads, 64, BLOCK_SIZE, dtype, g)
    # Scores of a few units: a cap of 3 bends them visibly.
    query = (torch.randn(len(lens), num_q_heads, 64, generator=g) * 4).to(dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125)
    out = attention_torch.paged_decode_attention(
        *args, sliding_window=sliding_window, logit_softcap=3.0
    )
    for b, n in enumerate(lens):
        k, v = kv.dense_kv(b)
        expected = masked_ref_attention(query[b : b + 1], k, v, 0.125, n - 1, sliding_window, 3.0)
        torch.testing.assert_close(out[b : b + 1].double(), expected, **ATTN_TOLERANCES[dtype])
    uncapped = attention_torch.paged_decode_attention(*args, sliding_window=sliding_window)
    assert (uncapped[1:] - out[1:]).abs().max() > 0.05


WINDOW_PREFILL_CASES = {
    # name: (new tokens per sequence, prefix tokens per sequence, window)
    "no_prefix": ([23], [0], 5),
    "no_prefix_window_one": ([9], [0], 1),
    "prefix_longer_than_window": ([5], [37], 8),
    "prefix_shorter_than_window": ([6], [10], 30),
    "window_covers_all": ([12], [20], 64),
    "window_from_inside_the_chunk": ([40], [3], 16),
    "mixed": ([1, 17, 5, 16, 20], [0, 16, 3, 0, 50], 11),
    "batched_equal": ([12, 12, 12], [0, 0, 0], 4),
    "batched_unequal": ([10, 13, 12, 9], [0, 0, 0, 0], 6),
}


def run_windowed_prefill_case(
    new_lens: list[int],
    prefix_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    seed: int,
    sliding_window: int,
    logit_softcap: float = 0.0,
    quantized: bool = False,
) -> None:
    g = gen(seed)
    head_dim = 64
    kv = make_paged_kv(prefix_lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, g, quantized)
    total = sum(new_lens)
    query = (torch.randn(total, num_q_heads, head_dim, generator=g) * 3).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, key, value, kv.k_cache, kv.v_cache, cu, kv.lens, kv.block_tables, 0.125)
    out = attention_torch.prefill_attention(
        *args,
        kv.k_scale,
        kv.v_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    for s, prefix in enumerate(prefix_lens):
        lo, hi = int(cu[s]), int(cu[s + 1])
        k_prefix, v_prefix = kv.dense_kv(s)
        k = torch.cat([k_prefix, key[lo:hi].double()])
        v = torch.cat([v_prefix, value[lo:hi].double()])
        expected = masked_ref_attention(
            query[lo:hi], k, v, 0.125, prefix, sliding_window, logit_softcap
        )
        torch.testing.assert_close(out[lo:hi].double(), expected, **ATTN_TOLERANCES[dtype])
    window_cuts = any(
        p + n > sliding_window > 0 for p, n in zip(prefix_lens, new_lens, strict=True)
    )
    if window_cuts or logit_softcap > 0:
        plain = attention_torch.prefill_attention(*args, kv.k_scale, kv.v_scale)
        assert not torch.equal(plain, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("case", list(WINDOW_PREFILL_CASES))
def test_prefill_attention_sliding_window(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, case: str
) -> None:
    new_lens, prefix_lens, window = WINDOW_PREFILL_CASES[case]
    run_windowed_prefill_case(
        new_lens, prefix_lens, num_q_heads, num_kv_heads, dtype, seed=window, sliding_window=window
    )


@pytest.mark.parametrize("sliding_window", [0, 7])
@pytest.mark.parametrize("case", ["no_prefix", "mixed", "batched_equal", "batched_unequal"])
def test_prefill_attention_logit_softcap(sliding_window: int, case: str) -> None:
    new_lens, prefix_lens, _ = WINDOW_PREFILL_CASES[case]
    run_windowed_prefill_case(
        new_lens, prefix_lens, 6, 2, torch.float32, 5, sliding_window, logit_softcap=2.5
    )


def test_prefill_attention_sliding_window_int8_prefix() -> None:
    run_windowed_prefill_case([4, 9], [40, 19], 6, 2, torch.float32, 6, 10, quantized=True)


# --- norms, rotary, activation --------------------------------------------------------------------


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (2, 3, 128)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = gen(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    out = ops.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_rms_norm(x, weight, 1e-6), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fused_add_rms_norm(dtype: torch.dtype, num_tokens: int) -> None:
    g = gen(num_tokens)
    x = torch.randn(num_tokens, 256, generator=g).to(dtype)
    residual = torch.randn(num_tokens, 256, generator=g).to(dtype)
    weight = torch.randn(256, generator=g).to(dtype)
    normed, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert normed.dtype == dtype and summed.dtype == dtype
    expected_sum = x.double() + residual.double()
    torch.testing.assert_close(summed.double(), expected_sum, **TOLERANCES[dtype])
    torch.testing.assert_close(
        normed.double(), ref_rms_norm(expected_sum, weight, 1e-5), **TOLERANCES[dtype]
    )


def rope_cache(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def ref_rotary(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Hugging Face's formula: x * cos + rotate_half(x) * sin, cos/sin repeated over halves."""
    cos, sin = cache[positions].double().chunk(2, dim=-1)
    cos = torch.cat([cos, cos], -1)[:, None, :]
    sin = torch.cat([sin, sin], -1)[:, None, :]
    x64 = x.double()
    x1, x2 = x64.chunk(2, dim=-1)
    return x64 * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_tokens", "num_q_heads", "num_kv_heads"), [(1, 3, 1), (13, 8, 2)])
def test_apply_rotary(
    dtype: torch.dtype, head_dim: int, num_tokens: int, num_q_heads: int, num_kv_heads: int
) -> None:
    g = gen(head_dim + num_tokens)
    cache = rope_cache(4096, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    # q and k as views of one fused projection output, as the model produces them.
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=g)
    qkv = qkv.to(dtype)
    query, key = qkv[:, :num_q_heads], qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    expected_q, expected_k = ref_rotary(query, positions, cache), ref_rotary(key, positions, cache)
    value_before = qkv[:, num_q_heads + num_kv_heads :].clone()
    q_out, k_out = ops.apply_rotary(query, key, positions, cache)
    torch.testing.assert_close(q_out.double(), expected_q, **TOLERANCES[dtype])
    torch.testing.assert_close(k_out.double(), expected_k, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, num_q_heads + num_kv_heads :], value_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(128, 96), (64, 16), (80, 78)])
def test_apply_rotary_partial(dtype: torch.dtype, head_dim: int, rotary_dim: int) -> None:
    """A cos|sin table narrower than the head rotates the first rotary_dim dims (pairs i,
    i + rotary_dim / 2) and leaves the rest bit for bit."""
    g = gen(rotary_dim)
    cache = rope_cache(512, rotary_dim)
    positions = torch.randint(0, 512, (7,), generator=g)
    qkv = torch.randn(7, 6 + 2 * 2, head_dim, generator=g).to(dtype)
    query, key = qkv[:, :6], qkv[:, 6:8]
    before = qkv.clone()
    expected_q = ref_rotary(query[..., :rotary_dim], positions, cache)
    expected_k = ref_rotary(key[..., :rotary_dim], positions, cache)
    ops.apply_rotary(query, key, positions, cache)
    torch.testing.assert_close(query[..., :rotary_dim].double(), expected_q, **TOLERANCES[dtype])
    torch.testing.assert_close(key[..., :rotary_dim].double(), expected_k, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, :8, rotary_dim:], before[:, :8, rotary_dim:])
    assert torch.equal(qkv[:, 8:], before[:, 8:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (5, 2 * 1536)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=gen(shape[0])) * 3).to(dtype)
    out = ops.silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    expected = gate / (1 + torch.exp(-gate)) * up
    assert out.shape == (shape[0], shape[1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
