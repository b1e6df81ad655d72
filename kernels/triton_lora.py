"""Batched multi-LoRA shrink and expand in Triton (Punica / S-LoRA segmented kernels).

Same contract as `kernels.lora_torch` (see its docstring for the layout). One program per
(segment, tile of the segment's tokens, tile of output columns): the program reads its
segment's slot, returns at once for slot -1 or a token tile past the segment's end, and
otherwise multiplies a [BLOCK_M, K] token tile by its slot's A (shrink) or an fp32 [BLOCK_M,
R] tile of the intermediate by its slot's B (expand, one output slice per column tile).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import lora_torch


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, RANK, K]
    out_ptr,  # [T, RANK] fp32
    seg_starts_ptr,  # [num_segments + 1] int32
    seg_slots_ptr,  # [num_segments] int32
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_out,
    RANK,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + segment)
    first = tl.load(seg_starts_ptr + segment) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_starts_ptr + segment + 1)
    if slot < 0 or first >= end:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < end
    n_mask = offs_n < RANK
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_n[None, :] * stride_a_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k_mask = start + offs_k < K
        x = tl.load(
            x_rows + start + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        a = tl.load(
            a_rows + start + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0
        )
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :],
        acc,
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _lora_expand_kernel(
    v_ptr,  # [T, SLICES * RANK] fp32
    b_ptr,  # [num_slots, N, RANK]
    y_ptr,  # [T, N], updated in place
    seg_starts_ptr,  # [num_segments + 1] int32
    seg_slots_ptr,  # [num_segments] int32
    scales_ptr,  # [num_slots] fp32
    slice_starts_ptr,  # [SLICES + 1] int32: output rows of each slice
    stride_v,
    stride_b_slot,
    stride_b_row,
    stride_y,
    RANK,
    TILES_PER_SLICE,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + segment)
    first = tl.load(seg_starts_ptr + segment) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_starts_ptr + segment + 1)
    if slot < 0 or first >= end:
        return
    out_slice = tl.program_id(2) // TILES_PER_SLICE
    slice_end = tl.load(slice_starts_ptr + out_slice + 1)
    offs_n = (
        tl.load(slice_starts_ptr + out_slice)
        + (tl.program_id(2) % TILES_PER_SLICE) * BLOCK_N
        + tl.arange(0, BLOCK_N)
    )
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < end
    n_mask = offs_n < slice_end
    r_mask = offs_r < RANK
    v = tl.load(
        v_ptr + offs_m[:, None].to(tl.int64) * stride_v + out_slice * RANK + offs_r[None, :],
        mask=m_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr
        + slot.to(tl.int64) * stride_b_slot
        + offs_n[None, :] * stride_b_row
        + offs_r[:, None],
        mask=n_mask[None, :] & r_mask[:, None],
        other=0.0,
    )
    delta = tl.dot(v, b.to(tl.float32), input_precision=DOT_PRECISION)
    y_tile = y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    y += delta * tl.load(scales_ptr + slot)
    tl.store(y_tile, y.to(y_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _token_tiles(seg_starts: Tensor, max_segment_len: int | None, block_m: int) -> int:
    if max_segment_len is None:  # a device sync: callers that know it pass it
        max_segment_len = int((seg_starts[1:] - seg_starts[:-1]).max().item())
    return max(1, triton.cdiv(max_segment_len, block_m))


def lora_shrink(
    x: Tensor,
    lora_a: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    out: Tensor,
    *,
    max_segment_len: int | None = None,
    block_m: int = 16,
    block_n: int = 16,
    block_k: int = 64,
) -> None:
    """Same contract as `kernels.lora_torch.lora_shrink`. max_segment_len: the longest
    segment's token count (read from seg_starts when not given, which syncs the device)."""
    lora_torch.check_shrink(x, lora_a, seg_starts, seg_slots, out)
    num_segments = seg_slots.shape[0]
    rank = lora_a.shape[1]
    if num_segments == 0 or x.shape[0] == 0 or rank == 0:
        return
    grid = (
        num_segments,
        _token_tiles(seg_starts, max_segment_len, block_m),
        triton.cdiv(rank, block_n),
    )
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        out,
        seg_starts,
        seg_slots,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        out.stride(0),
        rank,
        x.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype),
    )


def lora_expand(
    v: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None = None,
    *,
    max_segment_len: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
) -> None:
    """Same contract as `kernels.lora_torch.lora_expand`; max_segment_len as in lora_shrink."""
    slices = lora_torch.check_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)
    num_segments = seg_slots.shape[0]
    rank = lora_b.shape[2]
    if num_segments == 0 or y.shape[0] == 0 or rank == 0:
        return
    bounds = [0]
    for size in slices:
        bounds.append(bounds[-1] + size)
    slice_starts = torch.tensor(bounds, dtype=torch.int32).to(y.device, non_blocking=True)
    tiles_per_slice = triton.cdiv(max(slices), block_n)
    grid = (
        num_segments,
        _token_tiles(seg_starts, max_segment_len, block_m),
        len(slices) * tiles_per_slice,
    )
    _lora_expand_kernel[grid](
        v,
        lora_b,
        y,
        seg_starts,
        seg_slots,
        scales,
        slice_starts,
        v.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        rank,
        tiles_per_slice,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),  # 16: tl.dot's smallest K
        DOT_PRECISION=_dot_precision(y.dtype),
    )
