"""Varlen causal prefill attention in Triton (flash-style online softmax) over a paged prefix.

S sequences are packed along the token axis (cu_seqlens_q). Sequence s already has
prefix_lens[s] tokens in the paged cache (a prefix-cache hit or an earlier prefill chunk);
its new tokens sit at positions prefix_len .. prefix_len + n - 1 and come in as key/value.

    keys seen by new token i:  [ cached prefix 0 .. P-1 | new tokens 0 .. i ]
                                 read via block_tables     read from key/value, causal

One program per (BLOCK_M new tokens, sequence, query head). Phase 1 streams the prefix from
the paged cache with no causal mask (every prefix key precedes every new token); phase 2
streams the new keys up to the tile's diagonal with the causal mask.

With a sliding window W (new token at position p sees keys p - W < j <= p) both phases start
at the window of the tile's first token, so cached blocks before it are never read, and the
window is masked per row. Soft-capped logits (c > 0): scores c * tanh(scale * q.k / c).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import dequantize_kv_tile, soft_cap

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(
    q,
    k,
    v,
    acc,
    m_i,
    l_i,
    valid,
    qk_scale_log2,
    qk_scale,
    logit_softcap,
    DOT_PRECISION: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    """Folds one K/V tile into the running (acc, max, sum); valid [BLOCK_M, BLOCK_N]."""
    if USE_SOFTCAP:
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = soft_cap(scores, logit_softcap) * 1.4426950408889634  # log2(e)
    else:
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # Rows with nothing valid yet keep m = -inf; subtract 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(
        p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32
    )
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    query_ptr,  # [T, Hq, D]
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv, D // QUANT_GROUP] when IS_INT8
    v_scale_ptr,
    cu_seqlens_ptr,  # [S + 1]
    prefix_lens_ptr,  # [S]
    block_tables_ptr,  # [S, max_blocks]
    out_ptr,  # [T, Hq, D]
    qk_scale_log2,
    qk_scale,
    logit_softcap,
    sliding_window,
    stride_qt,
    stride_qh,
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
    stride_btb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_INT8: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    if m_block * BLOCK_M >= seq_len:
        return  # the grid is sized for the longest sequence
    prefix_len = tl.load(prefix_lens_ptr + seq)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < seq_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        query_ptr + (seq_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Phase 1: the cached prefix, through the block table, from the tile's first window.
    if USE_WINDOW:
        prefix_start = tl.maximum(prefix_len + m_block * BLOCK_M - sliding_window + 1, 0)
    else:
        prefix_start = 0
    for start in range(prefix_start, prefix_len, BLOCK_N):
        pos = start + offs_n
        pos_mask = pos < prefix_len
        block_ids = tl.load(
            block_tables_ptr + seq * stride_btb + pos // BLOCK_SIZE, mask=pos_mask, other=0
        ).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block_ids[:, None] * stride_kcb
            + in_block[:, None] * stride_kco
            + kv_head * stride_kch
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_vcb
            + in_block[:, None] * stride_vco
            + kv_head * stride_vch
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IS_INT8:
            k = dequantize_kv_tile(
                k,
                k_scale_ptr,
                block_ids,
                in_block,
                stride_ksb,
                stride_kso,
                kv_head * stride_ksh,
                offs_d,
                kv_mask,
                QUANT_GROUP,
            ).to(q.dtype)
            v = dequantize_kv_tile(
                v,
                v_scale_ptr,
                block_ids,
                in_block,
                stride_vsb,
                stride_vso,
                kv_head * stride_vsh,
                offs_d,
                kv_mask,
                QUANT_GROUP,
            ).to(q.dtype)
        valid = pos_mask[None, :]
        if USE_WINDOW:
            valid = valid & (pos[None, :] > prefix_len + offs_m[:, None] - sliding_window)
        acc, m_i, l_i = _online_softmax_step(
            q,
            k,
            v,
            acc,
            m_i,
            l_i,
            valid,
            qk_scale_log2,
            qk_scale,
            logit_softcap,
            DOT_PRECISION,
            USE_SOFTCAP,
        )

    # Phase 2: this chunk's own keys, causal; tiles past the diagonal (or before the window)
    # are skipped entirely.
    end = tl.minimum(seq_len, (m_block + 1) * BLOCK_M)
    new_start = tl.maximum(m_block * BLOCK_M - sliding_window + 1, 0) if USE_WINDOW else 0
    for start in range(new_start, end, BLOCK_N):
        pos = start + offs_n
        pos_mask = pos < seq_len
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(
            key_ptr
            + (seq_start + pos[:, None]) * stride_kt
            + kv_head * stride_kh
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            value_ptr
            + (seq_start + pos[:, None]) * stride_vt
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        causal = (pos[None, :] <= offs_m[:, None]) & pos_mask[None, :]
        if USE_WINDOW:
            causal = causal & (pos[None, :] > offs_m[:, None] - sliding_window)
        acc, m_i, l_i = _online_softmax_step(
            q,
            k,
            v,
            acc,
            m_i,
            l_i,
            causal,
            qk_scale_log2,
            qk_scale,
            logit_softcap,
            DOT_PRECISION,
            USE_SOFTCAP,
        )

    # Every valid row saw at least its own key, so l_i > 0 there; padded rows are not stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (seq_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    max_seqlen_q: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> Tensor:
    """Same contract as `kernels.attention_torch.prefill_attention`.

    `max_seqlen_q` (the longest new-token count) sizes the grid; pass it from the host-side
    batch to avoid a device sync.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = prefix_lens.shape[0]
    assert key.shape == (num_tokens, num_kv_heads, head_dim), f"key {tuple(key.shape)}"
    assert value.shape == key.shape, f"value {tuple(value.shape)}"
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and v_cache.shape == k_cache.shape
    is_int8 = k_cache.dtype == torch.int8
    assert is_int8 or k_cache.dtype == query.dtype, f"{k_cache.dtype=} != {query.dtype=}"
    if is_int8:
        assert k_scale is not None and v_scale is not None, "an int8 KV cache needs its scales"
        assert k_scale.shape[:3] == k_cache.shape[:3] and v_scale.shape == k_scale.shape
        assert k_scale.stride(3) == 1 and v_scale.stride(3) == 1
        quant_group = head_dim // k_scale.shape[3]
    else:
        k_scale = v_scale = k_cache  # unused placeholders
        quant_group = 1
    assert sliding_window >= 0 and logit_softcap >= 0
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        query,
        key,
        value,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        cu_seqlens_q,
        prefix_lens,
        block_tables,
        out,
        scale * LOG2E,
        scale,
        logit_softcap,
        sliding_window,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *k_scale.stride()[:3],
        *v_scale.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_INT8=is_int8,
        QUANT_GROUP=quant_group,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window > 0,
        USE_SOFTCAP=logit_softcap > 0,
    )
    return out
