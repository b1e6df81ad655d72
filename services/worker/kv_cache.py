"""The worker's paged KV cache: one preallocated tensor of fixed-size blocks for all layers.

Layout (one allocation, so the budget is exact and blocks are addressed the same in every layer):

    cache[layer, 0 = K | 1 = V, block_id, offset_in_block, kv_head, head_dim]

A token at position p of a sequence lives in slot block_table[p // block_size] * block_size +
p % block_size. Which blocks a sequence owns is the scheduler's business; the worker only reads
and writes the slots it is told.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import CapacityError
from services.worker.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        num_blocks = budget_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise CapacityError(
                f"a KV budget of {budget_bytes} bytes holds no block"
                f" of {self.bytes_per_block} bytes"
            )
        return int(num_blocks)


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.storage = torch.zeros(
            (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=device,
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storage[layer, 0], self.storage[layer, 1]) for layer in range(spec.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.storage.device)
        dst = torch.tensor([d for _, d in pairs], device=self.storage.device)
        self.storage[:, :, dst] = self.storage[:, :, src]
