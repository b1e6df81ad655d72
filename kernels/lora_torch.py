"""Batched multi-LoRA in torch (Punica / S-LoRA "shrink then expand" over token segments): the
CPU fallback and the oracle of the C++ and Triton kernels, plus the argument checks all three
share.

```
tokens   0 1 2 | 3 | 4 5 6 7 8 | 9          seg_starts = [0, 3, 4, 9, 10]
slot       2   | -1|     2     | 0          seg_slots  = [2, -1, 2, 0]
shrink   out[t, :]  = x[t] @ lora_a[slot].T                   (num_tokens, S * R) fp32
expand   y[t, rows of slice i] += scales[slot] * out[t, i*R:(i+1)*R] @ lora_b[slot, rows].T
```

R = lora_b.size(2) is the padded max rank (an adapter of rank r < R has zero rows r.. in A
and zero columns r.. in B, so padding changes nothing). S = len(out_slices) for a fused
projection (q|k|v: 3, gate|up: 2; 1 otherwise): lora_a stacks the slices' A matrices along
the rank, lora_b covers the concatenated output rows. Slot -1 means no adapter: neither `out`
nor `y` is written for its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LoraShapeError(ValueError):
    """An argument of a LoRA op has the wrong shape, dtype or layout; names the argument."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LoraShapeError(message)


def resolved_slices(out_slices: Sequence[int] | None, out_features: int) -> list[int]:
    """The output slice sizes, [out_features] when the projection is not fused."""
    if not out_slices:
        return [out_features]
    slices = [int(size) for size in out_slices]
    _require(
        all(size > 0 for size in slices) and sum(slices) == out_features,
        f"out_slices {slices} must be positive and sum to out_features {out_features}",
    )
    return slices


def check_segments(seg_starts: Tensor, seg_slots: Tensor) -> None:
    _require(
        seg_slots.dim() == 1 and seg_slots.dtype == torch.int32,
        f"seg_slots must be int32 (num_segments,), got {seg_slots.dtype} {tuple(seg_slots.shape)}",
    )
    _require(
        seg_starts.dtype == torch.int32 and seg_starts.shape == (seg_slots.shape[0] + 1,),
        f"seg_starts must be int32 (num_segments + 1,) = ({seg_slots.shape[0] + 1},), got "
        f"{seg_starts.dtype} {tuple(seg_starts.shape)}",
    )
    _require(seg_starts.device == seg_slots.device, "seg_starts and seg_slots on different devices")


def _check_input(x: Tensor, lora_a: Tensor) -> None:
    _require(
        x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.stride(-1) == 1,
        f"x must be (num_tokens, in_features) float with contiguous rows, got {x.dtype} "
        f"{tuple(x.shape)} strides {x.stride()}",
    )
    _require(
        lora_a.dim() == 3 and lora_a.shape[2] == x.shape[1] and lora_a.dtype == x.dtype,
        f"lora_a must be (num_slots, rank, in_features={x.shape[1]}) {x.dtype}, got "
        f"{lora_a.dtype} {tuple(lora_a.shape)}",
    )
    _require(lora_a.is_contiguous(), "lora_a must be contiguous")


def _check_output(
    y: Tensor, lora_b: Tensor, scales: Tensor, out_slices: Sequence[int] | None
) -> list[int]:
    _require(
        y.dim() == 2 and y.dtype in FLOAT_DTYPES and y.stride(-1) == 1,
        f"y must be (num_tokens, out_features) float with contiguous rows, got {y.dtype} "
        f"{tuple(y.shape)} strides {y.stride()}",
    )
    _require(
        lora_b.dim() == 3 and lora_b.shape[1] == y.shape[1] and lora_b.dtype == y.dtype,
        f"lora_b must be (num_slots, out_features={y.shape[1]}, rank) {y.dtype}, got "
        f"{lora_b.dtype} {tuple(lora_b.shape)}",
    )
    _require(lora_b.is_contiguous(), "lora_b must be contiguous")
    _require(
        scales.dtype == torch.float32 and scales.shape == (lora_b.shape[0],),
        f"scales must be float32 (num_slots,) = ({lora_b.shape[0]},), got {scales.dtype} "
        f"{tuple(scales.shape)}",
    )
    return resolved_slices(out_slices, y.shape[1])


def _check_intermediate(name: str, t: Tensor, num_tokens: int, rank: int) -> None:
    _require(
        t.dtype == torch.float32 and t.shape == (num_tokens, rank) and t.stride(-1) == 1,
        f"{name} must be float32 (num_tokens, slices * rank) = ({num_tokens}, {rank}) with "
        f"contiguous rows, got {t.dtype} {tuple(t.shape)}",
    )


def check_shrink(
    x: Tensor, lora_a: Tensor, seg_starts: Tensor, seg_slots: Tensor, out: Tensor
) -> None:
    _check_input(x, lora_a)
    _check_intermediate("out", out, x.shape[0], lora_a.shape[1])
    check_segments(seg_starts, seg_slots)


def check_expand(
    v: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None,
) -> list[int]:
    """Checks the arguments of an expand; returns the output slice sizes."""
    slices = _check_output(y, lora_b, scales, out_slices)
    _check_intermediate("v", v, y.shape[0], len(slices) * lora_b.shape[2])
    check_segments(seg_starts, seg_slots)
    return slices


def check_apply(
    x: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None,
) -> list[int]:
    """Checks the arguments of a shrink-then-expand; returns the output slice sizes."""
    _check_input(x, lora_a)
    slices = _check_output(y, lora_b, scales, out_slices)
    _require(y.shape[0] == x.shape[0], f"y has {y.shape[0]} tokens, x {x.shape[0]}")
    _require(
        lora_a.shape[0] == lora_b.shape[0],
        f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} differ in num_slots",
    )
    _require(
        lora_a.shape[1] == len(slices) * lora_b.shape[2],
        f"lora_a's rank {lora_a.shape[1]} must be slices x lora_b's rank = "
        f"{len(slices)} x {lora_b.shape[2]}",
    )
    check_segments(seg_starts, seg_slots)
    return slices


def segments(
    seg_starts: Tensor, seg_slots: Tensor, num_tokens: int, num_slots: int
) -> list[tuple[int, int, int]]:
    """(start, end, slot) of every non-empty segment with an adapter, values checked."""
    starts = seg_starts.tolist()
    slots = seg_slots.tolist()
    _require(
        starts[0] >= 0 and starts[-1] <= num_tokens,
        f"seg_starts must lie in [0, num_tokens={num_tokens}], got {starts[0]}..{starts[-1]}",
    )
    found = []
    for i, slot in enumerate(slots):
        _require(starts[i] <= starts[i + 1], f"seg_starts must not decrease (segment {i})")
        _require(
            -1 <= slot < num_slots, f"seg_slots[{i}] = {slot} is not -1 or a slot < {num_slots}"
        )
        if slot >= 0 and starts[i] < starts[i + 1]:
            found.append((starts[i], starts[i + 1], slot))
    return found


def lora_shrink(
    x: Tensor, lora_a: Tensor, seg_starts: Tensor, seg_slots: Tensor, out: Tensor
) -> None:
    """out[t] = x[t] @ lora_a[slot(t)].T in fp32, for the tokens of segments with a slot."""
    check_shrink(x, lora_a, seg_starts, seg_slots, out)
    for start, end, slot in segments(seg_starts, seg_slots, x.shape[0], lora_a.shape[0]):
        out[start:end] = x[start:end].float() @ lora_a[slot].float().T


def lora_expand(
    v: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None = None,
) -> None:
    """y[t] += scales[slot] * v[t] @ lora_b[slot].T per output slice, fp32 sums, one rounding to
    y's dtype; tokens of slot -1 untouched."""
    slices = check_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)
    rank = lora_b.shape[2]
    for start, end, slot in segments(seg_starts, seg_slots, y.shape[0], lora_b.shape[0]):
        b = lora_b[slot].float()
        parts = []
        row = 0
        for i, size in enumerate(slices):
            parts.append(v[start:end, i * rank : (i + 1) * rank] @ b[row : row + size].T)
            row += size
        delta = torch.cat(parts, dim=1) * scales[slot]
        y[start:end] = (y[start:end].float() + delta).to(y.dtype)


def lora_apply(
    x: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    seg_starts: Tensor,
    seg_slots: Tensor,
    scales: Tensor,
    y: Tensor,
    out_slices: Sequence[int] | None = None,
) -> None:
    """Shrink then expand: y[t] += scales[slot] * (x[t] @ lora_a[slot].T) @ lora_b[slot].T."""
    check_apply(x, lora_a, lora_b, seg_starts, seg_slots, scales, y, out_slices)
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    lora_shrink(x, lora_a, seg_starts, seg_slots, v)
    lora_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices)
