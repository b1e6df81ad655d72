"""Batch-invariant matmul in torch: each output row depends only on its own input row.

A library GEMM picks its kernel, blocking and thread split from the shape, so the same row
can be summed in a different order at M = 1 than at M = 37 (and bf16 rounds the difference
into a different token on near-ties). Feeding the GEMM tiles of one fixed shape (TILE_ROWS
rows, the last one zero-padded) gives every call the same kernel and every row the same
order, whatever M is. The C++ GGUF kernels have their own batch-invariant path
(kernels/csrc/gguf_gemm.cpp); this one serves float weights and the torch fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

TILE_ROWS = 16
"""Rows of every GEMM call: enough that prefill runs in few calls, few enough that a decode
step of one sequence pays little for the padding (the weights are read once per call)."""


def row_tiled(matmul: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """matmul(x_tile [TILE_ROWS, K]) -> [TILE_ROWS, N], applied to x [M, K] tile by tile."""
    m = x.shape[0]
    padded_rows = -(-m // TILE_ROWS) * TILE_ROWS if m else TILE_ROWS
    if padded_rows != m:
        padded = x.new_zeros(padded_rows, x.shape[1])
        padded[:m] = x
        x = padded
    tiles = [matmul(x[start : start + TILE_ROWS]) for start in range(0, padded_rows, TILE_ROWS)]
    return torch.cat(tiles)[:m]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x [M, K], weight [N, K], bias) with a batch-invariant row order."""
    out = row_tiled(lambda tile: tile @ weight.t(), x)
    return out if bias is None else out + bias
