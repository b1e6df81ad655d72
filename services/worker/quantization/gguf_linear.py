"""Layers over a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks: the buffer is the file's bytes,
row after row of blocks (kernels/gguf_blocks_torch.py draws the layout), and every call reads
it through `kernels.ops.gguf_linear` / `gguf_embedding`. fp32 activations get the exact
product; bf16/fp16 ones the int8-activation fast path (kernels/csrc/gguf_gemm.cpp)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels import ops
from kernels.gguf_blocks_torch import GGUF_KINDS, in_features
from services.worker.quantization.linear import QuantizedLinear

_KIND_NAMES = {kind: name for name, kind in GGUF_KINDS.items()}


class GGUFLinear(QuantizedLinear):
    """x [..., K] @ W^T with W held as GGUF blocks uint8 [N, K / 32 * block bytes]."""

    blocks: Tensor

    def __init__(
        self, blocks: Tensor, kind: int, bias: Tensor | None, *, int8_activations: bool = False
    ) -> None:
        super().__init__()
        self.kind = kind
        self.int8_activations = int8_activations
        """Round activations to int8 per 32 values at every dtype (llama.cpp's arithmetic);
        otherwise only bf16/fp16 activations are, and fp32 ones get the exact product."""
        self.batch_invariant = False
        """One arithmetic path at every batch size (services/worker/batch_invariance.py)."""
        self.out_features = blocks.shape[0]
        self.in_features = in_features(blocks, kind)
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", bias)

    def _matmul(self, x: Tensor) -> Tensor:
        return ops.gguf_linear(
            x, self.blocks, self.kind, self.int8_activations, self.batch_invariant
        )

    def extra_repr(self) -> str:
        activations = ", int8_activations=True" if self.int8_activations else ""
        invariant = ", batch_invariant=True" if self.batch_invariant else ""
        return f"{super().extra_repr()}, kind={_KIND_NAMES[self.kind]}{activations}{invariant}"


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
            f"{self.num_embeddings}, {self.embedding_dim}, kind={_KIND_NAMES[self.kind]}, "
            f"dtype={self.dtype}"
        )
