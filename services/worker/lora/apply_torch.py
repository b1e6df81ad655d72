"""The batched LoRA apply in torch: the reference of kernels' `lora_shrink`, `lora_expand` and
`lora_apply` (same signatures), and the CPU path until they land.

Tokens come in segments of one adapter slot each (a segment is one or more consecutive
sequences of the batch); slot -1 is the base model, whose rows are left alone:

    x [tokens, in] ── shrink: v = x @ A[slot]^T ──▶ v [tokens, max_rank]
                   ── expand: y += scales[slot] * v @ B[slot]^T ──▶ y [tokens, out] (in place)

    lora_a [slots, max_rank, in], lora_b [slots, out, max_rank], zero past each adapter's
    rank; seg_starts int32 [segments + 1], seg_slots int32 [segments], scales fp32 [slots].
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora_shrink(
    x: Tensor, lora_a: Tensor, seg_starts: Tensor, seg_slots: Tensor, out: Tensor
) -> None:
    """out[rows of a segment] = x[rows] @ lora_a[slot]^T; rows of slot -1 untouched."""
    starts = seg_starts.tolist()
    for index, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            start, end = starts[index], starts[index + 1]
            torch.matmul(x[start:end], lora_a[slot].t(), out=out[start:end])


def lora_expand(
    v: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
) -> None:
    """y[rows of a segment] += scales[slot] * v[rows] @ lora_b[slot]^T; rows of slot -1
    untouched."""
    starts = seg_starts.tolist()
    slot_scales = scales.tolist()
    for index, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            start, end = starts[index], starts[index + 1]
            y[start:end] += (v[start:end] @ lora_b[slot].t()) * slot_scales[slot]


def lora_apply(
    x: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
) -> None:
    """y += scales[slot] * (x @ lora_a[slot]^T) @ lora_b[slot]^T, per segment, in place."""
    v = x.new_zeros(x.shape[0], lora_a.shape[1])
    lora_shrink(x, lora_a, seg_starts, seg_slots, v)
    lora_expand(v, lora_b, seg_starts, seg_slots, scales, y)
