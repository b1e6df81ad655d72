"""GGUF's quantized blocks in torch: decoded to float exactly as the file defines them, and
the linear layer and embedding on top (dequantize, then one matmul). This is the path when
the C++ kernels (kernels/csrc/gguf_gemm.cpp) cannot build, and their test oracle.

Q4_0 / Q4_1 / Q8_0 are decoded here; every other kind the kernels read (Q5_0, Q5_1, the
K-quants Q2_K..Q6_K, IQ4_NL, IQ4_XS: kernels/csrc/gguf_formats.h draws their layouts) by the
gguf package's numpy decoders, which are llama.cpp's reference arithmetic.

    kind (ggml id)  bytes  one block = 32 values along K             value j
    Q4_0 (2)        18     d fp16 | 16 B of nibbles                  d * (q_j - 8)
    Q4_1 (3)        20     d fp16 | m fp16 | 16 B of nibbles         d * q_j + m
    Q8_0 (8)        34     d fp16 | 32 x int8                        d * q_j

A Q4 block stores q_j in the low nibble of byte j and q_{j+16} in its high nibble. A weight
[N, K] is `blocks` uint8 [N, K / 32 * bytes]: the file's blocks, row after row. d * q is
exact in fp32 (11-bit d times a 4- or 8-bit code); Q4_1 rounds once when adding m, as
ggml and the gguf package do.

The C++ op's bf16/fp16 path quantizes each 32-value block of an activation row to int8 with
one scale (`quantize_activation_blocks` is that rounding, written the same way, so the tests
can tell the kernel's arithmetic from the rounding it chooses), except for Q4 weights with at
least HALF_PANEL_MIN_ROWS rows of activations, where it computes in fp32 on exact weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

GGUF_Q4_0 = 2
GGUF_Q4_1 = 3
GGUF_Q8_0 = 8
BLOCK_VALUES = 32
BLOCK_BYTES = {GGUF_Q4_0: 18, GGUF_Q4_1: 20, GGUF_Q8_0: 34}
GROUP_SHAPES = {
    # ggml id: (values, bytes) of one block (or K-quant super-block)
    GGUF_Q4_0: (32, 18),
    GGUF_Q4_1: (32, 20),
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    GGUF_Q8_0: (32, 34),
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    20: (32, 18),  # IQ4_NL
    23: (256, 136),  # IQ4_XS
}
GGUF_KINDS = {
    "Q4_0": GGUF_Q4_0,
    "Q4_1": GGUF_Q4_1,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": GGUF_Q8_0,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "IQ4_NL": 20,
    "IQ4_XS": 23,
}
"""The tensor kinds the kernels compute on as stored, by their GGUF (ggml) names."""
KIND_NAMES = {kind: name for name, kind in GGUF_KINDS.items()}
SCALE_OFFSETS = {
    GGUF_Q4_0: (0,),
    GGUF_Q4_1: (0, 2),
    6: (0,),
    7: (0, 2),
    GGUF_Q8_0: (0,),
    10: (80, 82),
    11: (108,),
    12: (0, 2),
    13: (0, 2),
    14: (208,),
    20: (0,),
    23: (0,),
}
"""Byte offsets of each kind's fp16 fields (d, then m or dmin) inside one block: what a
random block must hold finite for its weights to be finite."""
GGUF_REPACKED_X8 = 256
"""Kind flag: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / Q2_K..Q6_K blocks regrouped by 8
rows at load (kernels/csrc/gguf_x8_layout.h), the layout the int8-activation kernels stream
best. Same bytes, so the same memory; only the C++ kernels read it."""
REPACKABLE_KINDS = (GGUF_Q4_0, GGUF_Q4_1, 6, 7, GGUF_Q8_0, 10, 11, 12, 13, 14, 20)


def kind_name(kind: int) -> str:
    """ "Q4_1", or "Q4_1 x8" for the repacked layout."""
    name = KIND_NAMES[kind & ~GGUF_REPACKED_X8]
    return f"{name} x8" if kind & GGUF_REPACKED_X8 else name


ACTIVATION_LEVELS = 127.0
HALF_PANEL_MIN_ROWS = 16
"""kHalfPanelMinRows of kernels/csrc/gguf_gemm.cpp (the tests hold the two equal)."""


def group_shape(kind: int) -> tuple[int, int]:
    """(values, bytes) of one block of `kind` (either layout)."""
    kind &= ~GGUF_REPACKED_X8
    if kind not in GROUP_SHAPES:
        known = ", ".join(f"{name} ({k})" for name, k in GGUF_KINDS.items())
        raise ValueError(f"GGUF block kind {kind} is not one of {known}")
    return GROUP_SHAPES[kind]


def in_features(blocks: Tensor, kind: int) -> int:
    """K of a weight stored as `blocks` [N, K / values * bytes]."""
    values, size = group_shape(kind)
    return blocks.shape[-1] // size * values


def _fp16_field(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 at byte `offset` of every block [..., bytes] -> fp32 [..., 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def dequantize_blocks(blocks: Tensor, kind: int) -> Tensor:
    """blocks uint8 [N, K / values * bytes] -> fp32 [N, K], the values the file defines."""
    n = blocks.shape[0]
    values, size = group_shape(kind)
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % size:
        raise ValueError(f"blocks must be uint8 [N, K / {values} * {size}], got {blocks.dtype}")
    if kind not in BLOCK_BYTES:
        from gguf import GGMLQuantizationType, quants

        decoded = quants.dequantize(blocks.cpu().numpy(), GGMLQuantizationType(kind))
        return torch.from_numpy(decoded).to(blocks.device)
    grouped = blocks.view(n, -1, size)
    d = _fp16_field(grouped, 0)
    if kind == GGUF_Q8_0:
        return (grouped[..., 2:].view(torch.int8).float() * d).view(n, -1)
    header = 4 if kind == GGUF_Q4_1 else 2
    nibbles = grouped[..., header:]
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).float()
    if kind == GGUF_Q4_1:
        return (d * codes + _fp16_field(grouped, 2)).view(n, -1)
    return (d * (codes - 8)).view(n, -1)


def gguf_linear(x: Tensor, blocks: Tensor, kind: int) -> Tensor:
    """x [M, K] @ dequant(blocks [N, ...])^T -> [M, N] in x.dtype, accumulated in fp32."""
    k = in_features(blocks, kind)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the blocks hold {k}")
    weight = dequantize_blocks(blocks, kind).to(x.device)
    return (x.float() @ weight.t()).to(x.dtype)


def gguf_embedding(token_ids: Tensor, blocks: Tensor, kind: int, dtype: torch.dtype) -> Tensor:
    """Rows `token_ids` of the table, dequantized exactly (then cast) -> [*ids, K]."""
    rows = blocks.index_select(0, token_ids.reshape(-1))
    values = dequantize_blocks(rows, kind).to(dtype)
    return values.view(*token_ids.shape, values.shape[-1])


SUPER_KINDS = (10, 11, 12, 13, 14, 23)
"""Q2_K..Q6_K and IQ4_XS: their int8 path rounds activations per 256 values (llama.cpp's
Q8_K), so each super-block is one integer dot; every other kind per 32."""


def activation_block(kind: int) -> int:
    """Values per activation scale on the int8 path for weights of `kind`."""
    return 256 if kind & ~GGUF_REPACKED_X8 in SUPER_KINDS else BLOCK_VALUES


def quantize_activation_blocks(x: Tensor, block: int = BLOCK_VALUES) -> Tensor:
    """The fast path's activations: each `block`-value block of a row rounded to int8 codes
    with one fp32 scale amax / 127 (round half to even), returned dequantized in fp32."""
    m, k = x.shape
    groups = x.float().view(m, k // block, block)
    scale = groups.abs().amax(dim=-1, keepdim=True) / ACTIVATION_LEVELS
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale)
    codes = torch.round(groups * inverse)
    return (codes * scale).view(m, k)
