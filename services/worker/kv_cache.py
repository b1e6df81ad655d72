"""The worker's paged KV cache: one preallocated tensor of fixed-size blocks for all layers.

Layout (one allocation, so the budget is exact and blocks are addressed the same in every layer):

    cache[layer, 0 = K | 1 = V, block_id, offset_in_block, kv_head, head_dim]

A token at position p of a sequence lives in slot block_table[p // block_size] * block_size +
p % block_size. Which blocks a sequence owns is the scheduler's business; the worker only reads
and writes the slots it is told.

An int8 cache (--kv-cache-dtype int8) has a second tensor of the same layout with one fp16
scale per `quant_group_size` values of head_dim, written with the codes (kernels quantize on
write and dequantize only the blocks an attention call reads):

    scales[layer, K | V, block_id, offset_in_block, kv_head, head_dim // quant_group_size]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.contracts.errors import CapacityError
from services.worker.huge_pages import huge_page_buffer
from services.worker.model.architecture import ModelArchitecture
from services.worker.quantization.formats import InvalidFormatError


class LayerKVCache(NamedTuple):
    """One layer's views of the cache; the scales are None unless the cache is int8."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    """Element type: the model dtype, or torch.int8 (then with group scales)."""
    quant_group_size: int = 8
    """int8 only: values of head_dim that share one scale."""
    scale_dtype: torch.dtype = torch.float16
    """int8 only: element type of the scales."""

    def __post_init__(self) -> None:
        if self.is_quantized and self.head_dim % self.quant_group_size:
            raise InvalidFormatError(
                f"--kv-cache-group-size {self.quant_group_size} does not divide"
                f" the model's head_dim {self.head_dim}"
            )

    @classmethod
    def for_model(
        cls,
        config: ModelArchitecture,
        block_size: int,
        dtype: torch.dtype,
        quant_group_size: int = 8,
    ) -> KVCacheSpec:
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            block_size,
            dtype,
            quant_group_size,
        )

    @property
    def is_quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def num_scales_per_head(self) -> int:
        return self.head_dim // self.quant_group_size if self.is_quantized else 0

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        scale = torch.tensor([], dtype=self.scale_dtype).element_size()
        per_head = self.head_dim * element + self.num_scales_per_head * scale
        return 2 * self.num_layers * self.num_kv_heads * per_head

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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros of `shape`, resident from the start (a machine short of memory fails here, not
    under load); on the host, on huge pages: attention reads blocks scattered over the whole
    cache, and a decode batch of 32 steps 2-3 % faster on the 1B-shaped file."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_page_buffer(nbytes).zero_().view(dtype).view(shape)


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.storage = _zeros(
            (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            spec.dtype,
            device,
        )
        self.scales: torch.Tensor | None = None
        if spec.is_quantized:
            self.scales = _zeros(
                (*self.storage.shape[:-1], spec.num_scales_per_head), spec.scale_dtype, device
            )
        self.layers: list[LayerKVCache] = [
            LayerKVCache(
                self.storage[layer, 0],
                self.storage[layer, 1],
                None if self.scales is None else self.scales[layer, 0],
                None if self.scales is None else self.scales[layer, 1],
            )
            for layer in range(spec.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.storage.device)
        dst = torch.tensor([d for _, d in pairs], device=self.storage.device)
        self.storage[:, :, dst] = self.storage[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of whole blocks, one row of raw bytes per block (what a KV transfer
        carries): the block's slice of every layer, K and V, then its int8 scales if any."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        parts = [self.storage[:, :, index]]
        if self.scales is not None:
            parts.append(self.scales[:, :, index])
        rows = [
            p.movedim(2, 0).contiguous().view(torch.uint8).reshape(len(block_ids), -1)
            for p in parts
        ]
        return torch.cat(rows, dim=1).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write rows of raw bytes made by `read_blocks` (on a worker with the same spec)
        into `block_ids`."""
        num_blocks = len(block_ids)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        data = data.to(self.storage.device).reshape(num_blocks, -1)
        offset = 0
        for tensor in (self.storage, self.scales):
            if tensor is None:
                continue
            shape = (num_blocks, *tensor.shape[:2], *tensor.shape[3:])
            element = tensor.element_size()
            size = element * int(torch.Size(shape[1:]).numel())
            part = data[:, offset : offset + size].contiguous().view(tensor.dtype)
            tensor[:, :, index] = part.reshape(shape).movedim(0, 2)
            offset += size
