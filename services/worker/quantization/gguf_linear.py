"""Layers over a GGUF file's own quantized blocks: each buffer is the file's bytes, row after
row of blocks (kernels/gguf_blocks_torch.py names the kinds, kernels/csrc/gguf_formats.h draws
the layouts), and every call reads them through `kernels.ops`. With `int8_activations` (the
default of `--quantization gguf`) activations are rounded to int8 per 32 values and the
products are integer dot products, llama.cpp's arithmetic; without (`gguf-exact`) fp32
activations get the exact product and bf16/fp16 ones the int8 path."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels import ops
from kernels.gguf_blocks_torch import in_features, kind_name
from services.worker.quantization.linear import QuantizedLinear


class GGUFLinear(QuantizedLinear):
    """x [..., K] @ W^T with W held as GGUF blocks: one tensor uint8 [N, K / values * bytes]
    of one kind, or (a fused layer whose parts the file stores in different kinds) several,
    their outputs side by side."""

    def __init__(
        self,
        blocks: Tensor | list[Tensor],
        kind: int | list[int],
        bias: Tensor | None,
        *,
        int8_activations: bool = False,
    ) -> None:
        super().__init__()
        parts = list(blocks) if isinstance(blocks, list) else [blocks]
        kinds = list(kind) if isinstance(kind, list) else [kind]
        if len(parts) != len(kinds) or not parts:
            raise ValueError("GGUFLinear needs one kind per part, and at least one part")
        self.kinds = kinds
        self.int8_activations = int8_activations
        """Round activations to int8 per 32 values at every dtype (llama.cpp's arithmetic);
        otherwise only bf16/fp16 activations are, and fp32 ones get the exact product."""
        self.batch_invariant = False
        """One arithmetic path at every batch size (services/worker/batch_invariance.py)."""
        self.out_features = sum(part.shape[0] for part in parts)
        self.in_features = in_features(parts[0], kinds[0])
        for index, (part, part_kind) in enumerate(zip(parts, kinds, strict=True)):
            if in_features(part, part_kind) != self.in_features:
                raise ValueError("GGUFLinear parts must have the same number of inputs")
            self.register_buffer(f"blocks_{index}", part)
        self.register_buffer("bias", bias)

    @property
    def parts(self) -> list[Tensor]:
        """The block tensors, in output order."""
        return [getattr(self, f"blocks_{index}") for index in range(len(self.kinds))]

    def _matmul(self, x: Tensor) -> Tensor:
        if len(self.kinds) == 1:
            return ops.gguf_linear(
                x, self.blocks_0, self.kinds[0], self.int8_activations, self.batch_invariant
            )
        return ops.gguf_linear_parts(
            x, self.parts, self.kinds, self.int8_activations, self.batch_invariant
        )

    def extra_repr(self) -> str:
        kinds = "|".join(kind_name(kind) for kind in self.kinds)
        activations = ", int8_activations=True" if self.int8_activations else ""
        invariant = ", batch_invariant=True" if self.batch_invariant else ""
        return f"{super().extra_repr()}, kind={kinds}{activations}{invariant}"


class GGUFEmbedding(nn.Module):
    """Token embedding whose rows are GGUF blocks, dequantized exactly on lookup (then cast to
    `dtype`). A tied output layer is a GGUFLinear over the same buffer."""

    blocks: Tensor

    def __init__(self, blocks: Tensor, kind: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.dtype = dtype
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = in_features(blocks, kind)
        self.register_buffer("blocks", blocks)

    def forward(self, token_ids: Tensor) -> Tensor:
        return ops.gguf_embedding(token_ids, self.blocks, self.kind, self.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, kind={kind_name(self.kind)}, "
            f"dtype={self.dtype}"
        )
