"""What a forward batch with adapter rows carries: the segment table over its flattened tokens
and the slots; and what each decoder layer takes from it (`LoraBatch.layer`): the table and
that layer's A and B, with the one call each projection makes after its base product.

    tokens     [ p0 p0 p0 | p1 p1 | d0 | d1 | d2 ]      (forward_batch.py's order)
    adapter      slot 2     none    2    2    0
    seg_starts [ 0,         3,      5,        7, 8 ]   runs of one slot (neighbours merged)
    seg_slots  [ 2,         -1,     2,        0 ]

A layer's tables come in as an argument, as its KV cache does, and not by its index: a compiled
step (step_graphs.py) then runs one graph for every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# The batched apply: the C++ op on CPU, Triton on GPU, kernels/lora_torch.py elsewhere.
from kernels import ops as lora_ops
from services.worker.lora.slots import LayerTables, LoraSlots


@dataclass(slots=True)
class LoraBatch:
    seg_starts: Tensor
    """[segments + 1] int32 first token of each segment, then the number of tokens."""
    seg_slots: Tensor
    """[segments] int32 slot of each segment's adapter, -1 for the base model."""
    slots: LoraSlots

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(
            self.seg_starts, self.seg_slots, self.slots.scales, self.slots.layers[index]
        )

    def row_slots(self, num_rows: int) -> Tensor:
        """[num_rows] int32 slot of each row, the segment table unrolled; `lora_batch`'s tables
        start at row 0 and cover every row."""
        counts = self.seg_starts[1:] - self.seg_starts[:-1]
        return torch.repeat_interleave(self.seg_slots, counts, output_size=num_rows)


@dataclass(frozen=True, slots=True)
class LoraLayer:
    """One decoder layer's share of a LoraBatch."""

    seg_starts: Tensor
    seg_slots: Tensor
    scales: Tensor
    tables: LayerTables

    def add(self, projection: str, x: Tensor, y: Tensor) -> None:
        """y += each row's adapter delta of `projection` (y = base(x), in place)."""
        lora_ops.lora_apply(
            x,
            self.tables.lora_a[projection],
            self.tables.lora_b[projection],
            self.seg_starts,
            self.seg_slots,
            self.scales,
            y,
        )


def segment_table(rows: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(seg_starts, seg_slots) of sequences given in token order as (number of rows, slot);
    neighbours of one slot form one segment."""
    starts = [0]
    slots: list[int] = []
    for num_rows, slot in rows:
        if num_rows == 0:
            continue
        if slots and slots[-1] == slot:
            starts[-1] += num_rows
        else:
            slots.append(slot)
            starts.append(starts[-1] + num_rows)
    return starts, slots


def lora_batch(
    rows: Sequence[tuple[int, int]], slots: LoraSlots, device: torch.device
) -> LoraBatch:
    starts, seg_slots = segment_table(rows)
    return LoraBatch(
        seg_starts=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
        seg_slots=torch.tensor(seg_slots, dtype=torch.int32).to(device, non_blocking=True),
        slots=slots,
    )
