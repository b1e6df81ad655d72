"""Paged decode attention in Triton: flash-decoding (split-K over the context) with GQA.

One program handles one (sequence, KV head, context split) and all G = Hq / Hkv query heads
that share the KV head, so each K/V tile is loaded once per group instead of once per head.
Long contexts are cut into partitions of `partition_size` tokens that run in parallel; each
writes a partial output normalised by its own softmax sum plus its log-sum-exp, and a second
kernel merges them. With a single partition the first kernel writes the final output itself.

    grid (B, Hkv, num_splits)            grid (B, Hq)
    ┌──────────────────────────┐         ┌──────────────────────────────┐
    │ split s: tokens          │  lse,   │ out = Σ_s exp(lse_s - M) o_s │
    │ [s*P, min((s+1)*P, len)) │──o_s──▶ │      / Σ_s exp(lse_s - M)    │
    └──────────────────────────┘         └──────────────────────────────┘

Token position p of sequence b lives at k_cache[block_tables[b, p // block_size],
p % block_size]. Optional int8 K/V carry one scale per group of head_dim values.

With a sliding window W the splits start at the window (context_len - W), not at token 0:
the blocks before it are never read and the grid holds ceil(W / P) splits at most. With
soft-capped logits (c > 0) the scores are c * tanh(scale * q.k / c) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import dequantize_kv_tile, soft_cap

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    query_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv, D // QUANT_GROUP] when IS_INT8
    v_scale_ptr,
    block_tables_ptr,  # [B, max_blocks]
    context_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D] when ONE_SPLIT
    partial_out_ptr,  # [B, Hq, max_splits, D] fp32 otherwise
    partial_lse_ptr,  # [B, Hq, max_splits] fp32 otherwise
    qk_scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    qk_scale,  # the softmax scale itself (soft-capping needs the unscaled logit)
    logit_softcap,
    sliding_window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_ksb,
    stride_kso,
    stride_ksh,
    stride_vsb,
    stride_vso,
    stride_vsh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    PARTITION: tl.constexpr,  # tokens per split, a multiple of BLOCK_N
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per inner step
    IS_INT8: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if USE_WINDOW:
        split_start = tl.maximum(context_len - sliding_window, 0) + split * PARTITION
    else:
        split_start = split * PARTITION
    if split_start >= context_len:
        return  # the merge kernel ignores splits past the context
    split_end = tl.minimum(split_start + PARTITION, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g
    q = tl.load(
        query_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(split_start, split_end, BLOCK_N):
        pos = start + offs_n
        pos_mask = pos < split_end
        # Each token finds its page; a tile may span several pages.
        block_ids = tl.load(
            block_tables_ptr + seq * stride_btb + pos // BLOCK_SIZE, mask=pos_mask, other=0
        ).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k_off = block_ids[:, None] * stride_kb + in_block[:, None] * stride_ko + offs_d[None, :]
        v_off = block_ids[:, None] * stride_vb + in_block[:, None] * stride_vo + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_head * stride_kh + k_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_head * stride_vh + v_off, mask=kv_mask, other=0.0)
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

        if USE_SOFTCAP:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            scores = soft_cap(scores, logit_softcap) * 1.4426950408889634  # log2(e)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
        m_i = m_new

    out = acc / l_i[:, None]
    out_mask = head_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:
        tl.store(
            out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        tl.store(
            partial_out_ptr
            + seq * stride_pb
            + q_heads[:, None] * stride_ph
            + split * stride_ps
            + offs_d[None, :],
            out,
            mask=out_mask,
        )
        tl.store(
            partial_lse_ptr + seq * stride_lb + q_heads * stride_lh + split,
            m_i + tl.log2(l_i),
            mask=head_mask,
        )


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr,  # [B, Hq, max_splits, D] fp32
    partial_lse_ptr,  # [B, Hq, max_splits] fp32, log2 units
    context_lens_ptr,
    out_ptr,  # [B, Hq, D]
    sliding_window,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PARTITION: tl.constexpr,
    BLOCK_S: tl.constexpr,  # max_splits padded to a power of two
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    if USE_WINDOW:
        context_len = tl.minimum(context_len, sliding_window)  # tokens attended
    num_splits = tl.cdiv(context_len, PARTITION)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    # Splits past this sequence's context were never written: mask them, never read them.
    lse = tl.load(
        partial_lse_ptr + seq * stride_lb + head * stride_lh + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    parts = tl.load(
        partial_out_ptr
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    partition_size: int = 512,
    max_context_len: int | None = None,
) -> Tensor:
    """Same contract as `kernels.attention_torch.paged_decode_attention`.

    `max_context_len` (an upper bound on context_lens) sizes the split grid; pass it from the
    host-side batch to avoid a device sync. `partition_size` is the tokens per split.
    """
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    is_int8 = k_cache.dtype == torch.int8
    assert is_int8 or k_cache.dtype == query.dtype, f"{k_cache.dtype=} != {query.dtype=}"
    if is_int8:
        assert k_scale is not None and v_scale is not None, "an int8 KV cache needs its scales"
        assert k_scale.shape[:3] == k_cache.shape[:3] and k_scale.stride(3) == 1
        assert v_scale.shape == k_scale.shape and v_scale.stride(3) == 1
        quant_group = head_dim // k_scale.shape[3]
    else:
        k_scale = v_scale = k_cache  # unused placeholders; the kernel never reads them
        quant_group = 1
    group = num_q_heads // num_kv_heads
    block_n = 32
    assert partition_size % block_n == 0, f"partition_size must be a multiple of {block_n}"
    assert sliding_window >= 0 and logit_softcap >= 0
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    attended = min(max_context_len, sliding_window) if sliding_window > 0 else max_context_len
    num_splits = triton.cdiv(attended, partition_size)

    out = torch.empty_like(query)
    one_split = num_splits == 1
    if one_split:
        partial_out = partial_lse = out  # unused
    else:
        partial_out = torch.empty(
            batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            batch, num_q_heads, num_splits, dtype=torch.float32, device=query.device
        )
    block_d = triton.next_power_of_2(head_dim)
    # fp32 inputs would silently use TF32 on Ampere+; decode is memory-bound, keep it exact.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        out,
        partial_out,
        partial_lse,
        scale * LOG2E,
        scale,
        logit_softcap,
        sliding_window,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *k_scale.stride()[:3],
        *v_scale.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *(partial_out.stride()[:3] if not one_split else (0, 0, 0)),
        *(partial_lse.stride()[:2] if not one_split else (0, 0)),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PARTITION=partition_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        IS_INT8=is_int8,
        QUANT_GROUP=quant_group,
        ONE_SPLIT=one_split,
        DOT_PRECISION=precision,
        USE_WINDOW=sliding_window > 0,
        USE_SOFTCAP=logit_softcap > 0,
    )
    if not one_split:
        _decode_merge_kernel[(batch, num_q_heads)](
            partial_out,
            partial_lse,
            context_lens,
            out,
            sliding_window,
            *partial_out.stride()[:3],
            *partial_lse.stride()[:2],
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            PARTITION=partition_size,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            USE_WINDOW=sliding_window > 0,
        )
    return out
