"""Random batched multi-LoRA inputs (adapters of several ranks zero-padded to a max rank,
segments with shared slots and slot -1) and the check of an implementation against
kernels/lora_torch.py; shared by test_lora_kernels.py and the C++ variant builds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import lora_torch

# name -> (segment lengths, their slots): decode, prefill and both mixed; empty segments,
# consecutive segments sharing a slot, tokens past the last segment (the 2 trailing ones).
LAYOUTS: dict[str, tuple[list[int], list[int]]] = {
    "decode": ([1] * 16, [0, 1, -1, 2, 0, 0, 3, 1, -1, 2, 2, 0, 3, 3, 1, 0]),
    "prefill": ([37, 0, 50], [1, 2, 1]),
    "mixed": ([1, 1, 20, 0, 1, 9, 3, 1], [0, -1, 2, 1, 0, 0, -1, 3]),
    "one adapter": ([5, 1, 1, 1], [2, 2, 2, 2]),
    "no adapter": ([4, 1, 2], [-1, -1, -1]),
    "no segment": ([], []),
}
# (max rank, the ranks of slots 0.. before padding)
RANKS: dict[str, tuple[int, list[int]]] = {
    "r64": (64, [1, 8, 16, 64]),
    "r16": (16, [16, 8, 1, 16]),
    "r8": (8, [8, 3, 1, 8]),  # half an AVX-512 vector: the AVX2 expand on an AVX-512 build
    "r12": (12, [12, 5, 1, 7]),  # not a multiple of any vector width
}
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class LoraCase:
    x: Tensor
    lora_a: Tensor  # (num_slots, S * R, K)
    lora_b: Tensor  # (num_slots, N, R)
    seg_starts: Tensor
    seg_slots: Tensor
    scales: Tensor
    y: Tensor  # the base output, never modified: ops run on clones
    out_slices: list[int] | None
    ranks: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.x.shape[0])

    @property
    def intermediate_width(self) -> int:
        return int(self.lora_a.shape[1])

    def touched_rows(self) -> Tensor:
        """Tokens of segments with a slot (the rows an op may write)."""
        touched = torch.zeros(self.num_tokens, dtype=torch.bool)
        starts = self.seg_starts.tolist()
        for i, slot in enumerate(self.seg_slots.tolist()):
            if slot >= 0:
                touched[starts[i] : starts[i + 1]] = True
        return touched

    def intermediate(self, fill: float = 7.0) -> Tensor:
        return torch.full((self.num_tokens, self.intermediate_width), fill)

    def reference_intermediate(self) -> Tensor:
        v = self.intermediate(0.0)
        lora_torch.lora_shrink(self.x, self.lora_a, self.seg_starts, self.seg_slots, v)
        return v


def make_case(
    layout: str,
    ranks_name: str,
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    in_features: int = 96,
    out_features: int = 80,
    out_slices: Sequence[int] | None = None,
    trailing_tokens: int = 2,
) -> LoraCase:
    lengths, slots = LAYOUTS[layout]
    max_rank, ranks = RANKS[ranks_name]
    num_slots = len(ranks)
    num_slices = len(out_slices) if out_slices else 1
    num_tokens = sum(lengths) + trailing_tokens
    lora_a = torch.zeros(num_slots, num_slices * max_rank, in_features)
    lora_b = torch.zeros(num_slots, out_features, max_rank)
    for slot, rank in enumerate(ranks):
        for s in range(num_slices):
            lora_a[slot, s * max_rank : s * max_rank + rank] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            )
        lora_b[slot, :, :rank] = torch.randn(out_features, rank, generator=generator)
    if out_slices and num_slices == 3:
        # Slot 0 adapts q only: its k and v rows of B (and A) are zero.
        lora_b[0, out_slices[0] :] = 0
        lora_a[0, max_rank:] = 0
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return LoraCase(
        x=torch.randn(num_tokens, in_features, generator=generator).to(dtype),
        lora_a=lora_a.to(dtype),
        lora_b=lora_b.to(dtype),
        seg_starts=torch.tensor(starts, dtype=torch.int32),
        seg_slots=torch.tensor(slots, dtype=torch.int32),
        scales=torch.rand(num_slots, generator=generator) + 0.5,
        y=torch.randn(num_tokens, out_features, generator=generator).to(dtype),
        out_slices=list(out_slices) if out_slices else None,
        ranks=ranks,
    )


def exact_output(case: LoraCase) -> Tensor:
    """y + the LoRA deltas in fp64, token by token from the unpadded adapters (so the padding
    is checked too); what the torch reference must match."""
    y = case.y.double().clone()
    slices = case.out_slices or [case.y.shape[1]]
    max_rank = case.lora_b.shape[2]
    slot_of = torch.full((case.num_tokens,), -1)
    starts = case.seg_starts.tolist()
    for i, slot in enumerate(case.seg_slots.tolist()):
        slot_of[starts[i] : starts[i + 1]] = slot
    for t in range(case.num_tokens):
        slot = int(slot_of[t])
        if slot < 0:
            continue
        rank = case.ranks[slot]
        row = 0
        for s, size in enumerate(slices):
            a = case.lora_a[slot, s * max_rank : s * max_rank + rank].double()
            b = case.lora_b[slot, row : row + size, :rank].double()
            y[t, row : row + size] += float(case.scales[slot]) * (b @ (a @ case.x[t].double()))
            row += size
    return y


ShrinkFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
ExpandFn = Callable[..., None]


def check_against_reference(
    case: LoraCase, shrink: ShrinkFn, expand: ExpandFn, apply: ExpandFn | None
) -> None:
    """shrink, expand and apply against lora_torch: touched rows close, the others (slot -1,
    tokens past the last segment) bitwise as they were."""
    touched = case.touched_rows()
    tolerance = TOLERANCES[case.x.dtype]

    out = case.intermediate()
    shrink(case.x, case.lora_a, case.seg_starts, case.seg_slots, out)
    want_v = case.reference_intermediate()
    torch.testing.assert_close(out[touched], want_v[touched], **TOLERANCES[torch.float32])
    assert bool((out[~touched] == 7.0).all()), "shrink wrote rows of tokens without an adapter"

    want_y = case.y.clone()
    lora_torch.lora_expand(
        want_v, case.lora_b, case.seg_starts, case.seg_slots, case.scales, want_y, case.out_slices
    )
    for name, run in (("expand", expand), ("apply", apply)):
        if run is None:
            continue
        y = case.y.clone()
        if name == "expand":
            run(
                want_v,
                case.lora_b,
                case.seg_starts,
                case.seg_slots,
                case.scales,
                y,
                case.out_slices,
            )
        else:
            run(
                case.x,
                case.lora_a,
                case.lora_b,
                case.seg_starts,
                case.seg_slots,
                case.scales,
                y,
                case.out_slices,
            )
        torch.testing.assert_close(y, want_y, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(y[~touched], case.y[~touched]), f"{name} changed rows without an adapter"
