"""The device slots: `max_loras` adapters' A and B, stacked and zero-padded per projection, so
one batched apply serves rows of every adapter at once.

Per projection, for every layer (layers first, so one layer's slice is a contiguous
[slots, ...] block, the shape the apply ops take):

    lora_a  [layers, slots, parts * max_rank, in]
    lora_b  [layers, slots, out, parts * max_rank]

A fused projection (q|k|v, gate|up) gives each part its own block of max_rank columns: the
shrink computes every part's A at once, and B is block-diagonal, its rows covering the
concatenated output, zero where the adapter does not target that part:

    lora_b of qkv        cols: [ q: 0..R | k: R..2R | v: 2R..3R ]
      rows q (q_size)          [  B_q    |    0     |     0     ]
      rows k (kv_size)         [   0     |   B_k    |     0     ]
      rows v (kv_size)         [   0     |    0     |    B_v    ]

A whole-projection target of a fused checkpoint (Phi-3's qkv_proj) takes block 0 and every
row. Columns past an adapter's rank stay zero, so padding adds exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.worker.lora.adapter import PROJECTIONS, LoraAdapter, projection_shapes
from services.worker.model.architecture import ModelArchitecture


@dataclass(frozen=True, slots=True)
class LayerTables:
    """One layer's A and B of each projection: [slots, ...] views into the stacked tables,
    made once, so `write` and `clear` reach them in place."""

    lora_a: dict[str, Tensor]
    lora_b: dict[str, Tensor]


class LoraSlots:
    def __init__(
        self,
        arch: ModelArchitecture,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.shapes = projection_shapes(arch)
        layers = arch.num_layers
        self.lora_a: dict[str, Tensor] = {}
        self.lora_b: dict[str, Tensor] = {}
        for projection in PROJECTIONS:
            shape = self.shapes[projection]
            width = len(shape.part_sizes) * max_rank
            self.lora_a[projection] = torch.zeros(
                layers, num_slots, width, shape.in_features, dtype=dtype, device=device
            )
            self.lora_b[projection] = torch.zeros(
                layers, num_slots, shape.out_features, width, dtype=dtype, device=device
            )
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.layers = [
            LayerTables(
                {projection: table[layer] for projection, table in self.lora_a.items()},
                {projection: table[layer] for projection, table in self.lora_b.items()},
            )
            for layer in range(layers)
        ]

    @property
    def num_bytes(self) -> int:
        tensors = [*self.lora_a.values(), *self.lora_b.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put an adapter (checked against the model) in a slot, over whatever it held."""
        self.clear(slot)
        for target, (a, b) in adapter.weights.items():
            start, end = self.shapes[target.projection].rows(target)
            rank = a.shape[0]
            columns = slice(target.part * self.max_rank, target.part * self.max_rank + rank)
            if target.num_parts == 1:
                columns = slice(0, rank)
            lora_a = self.lora_a[target.projection][target.layer, slot]
            lora_b = self.lora_b[target.projection][target.layer, slot]
            lora_a[columns].copy_(a)
            lora_b[start:end, columns].copy_(b)
        self.scales[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        for projection in PROJECTIONS:
            self.lora_a[projection][:, slot].zero_()
            self.lora_b[projection][:, slot].zero_()
        self.scales[slot] = 0.0
