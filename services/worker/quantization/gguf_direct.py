"""Serve a GGUF file's quantized tensors as the file stores them: Q4_0, Q4_1 and Q8_0 blocks
are kept byte for byte and read by the GGUF kernels (kernels/csrc/gguf_gemm.cpp), so the
weights in memory are the file's and nothing is rounded a second time.

    tensors of a layer                       becomes
    one kind of Q4_0 / Q4_1 / Q8_0           GGUFLinear over the file's block rows
    Q4_0 mixed with Q4_1                     Int4Linear: code q, scale d, zero m + 8d (the
                                             zero rounded to the activation dtype)
    anything else (K-quants, F16, F32, ...)  stays as the float loader made it

A fused layer (q|k|v, gate|up) stacks its parts' block rows: rows are independent, and the
q/k row order fix of the float loader (`unpermute_rows`) moves whole block rows. A Q4_0 /
Q4_1 / Q8_0 token_embd becomes a GGUFEmbedding and, in a tied model, the output layer is a
GGUFLinear over the same buffer (one copy). Otherwise the embedding and output layer become
int8 per row, as for the other formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kernels.gguf_blocks_torch import GGUF_KINDS
from services.common.gguf_metadata import open_gguf
from services.worker.loader.gguf_loader import qk_heads, unpermute_rows
from services.worker.loader.weight_names import gguf_part
from services.worker.model.causal_lm import CausalLM
from services.worker.model.families import gguf_model_architecture
from services.worker.quantization.formats import InvalidFormatError
from services.worker.quantization.gguf_linear import GGUFEmbedding, GGUFLinear
from services.worker.quantization.linear import Int4Linear, Int8WeightOnlyLinear
from services.worker.quantization.swap import quantize_output_and_embedding

GGUF_BLOCK = 32


@dataclass(frozen=True, slots=True)
class BlockRows:
    """One tensor as the file stores it: `rows` uint8 [N, K / 32 * block bytes]."""

    kind: str
    rows: np.ndarray


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """codes uint8 [N, K] in 0..15, scale and zero fp32 [N, K / 32]: W = (q - 8) s + z."""

    codes: Tensor
    scale: Tensor
    zero: Tensor


def decode_q4(raw: np.ndarray, rows: int, kind: str) -> Int4Codes:
    """Raw Q4_0 / Q4_1 bytes [rows, row_bytes] -> codes and group scales."""
    header = 4 if kind == "Q4_1" else 2
    blocks = raw.reshape(rows, -1, header + GGUF_BLOCK // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    nibbles = blocks[..., header:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, -1)
    return Int4Codes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def read_block_rows(reader: Any) -> dict[str, list[BlockRows]]:
    """Our parameter name -> its parts' rows of blocks (in part order), for every parameter
    whose parts are all of kinds the kernels read."""
    family, arch = gguf_model_architecture(reader)
    parts: dict[str, dict[int, BlockRows]] = {}
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        where = gguf_part(family, tensor.name)
        if where is None:
            continue
        counts[where.parameter] = where.num_parts
        kind = tensor.tensor_type.name
        if kind not in GGUF_KINDS:
            continue
        rows = np.asarray(tensor.data)  # [N, row bytes], mapped read-only from the file
        # The same row order fix as the float loader (llama.cpp interleaves rotary halves).
        heads = qk_heads(family, arch, where.parameter, where.part)
        if heads:
            rows = unpermute_rows(rows, heads)
        parts.setdefault(where.parameter, {})[where.part] = BlockRows(kind, rows)
    return {
        name: [found[i] for i in range(counts[name])]
        for name, found in parts.items()
        if len(found) == counts[name]
    }


def _buffer(rows: list[np.ndarray]) -> Tensor:
    """The parts' rows stacked into one writable, contiguous uint8 tensor (a copy)."""
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(rows, axis=0)))


def _int4_layer(parts: list[BlockRows], bias: Tensor | None, dtype: torch.dtype) -> Int4Linear:
    """Q4_0 and Q4_1 parts in one fused layer: the int4 layer with the file's codes."""
    decoded = [decode_q4(p.rows, p.rows.shape[0], p.kind) for p in parts]
    return Int4Linear(
        torch.cat([c.codes for c in decoded]),
        torch.cat([c.scale for c in decoded]),
        torch.cat([c.zero for c in decoded]),
        bias,
        dtype,
    )


def load_gguf_quantized(model: CausalLM, path: Path, *, int8_activations: bool = False) -> None:
    """Swap `model`'s (float, already loaded) layers for the file's own quantized tensors;
    `int8_activations`: their products round activations to int8 blocks at every dtype."""
    if path.suffix != ".gguf":
        raise InvalidFormatError(f"--quantization gguf needs a .gguf model, got {path}")
    found = read_block_rows(open_gguf(path))
    dtype = model.norm.dtype

    def from_file_type(linear: torch.nn.Module, name: str) -> torch.nn.Module:
        assert isinstance(linear, torch.nn.Linear)
        bias = None if linear.bias is None else linear.bias.data
        present = found.get(name)
        if present is None:
            return linear
        kinds = {p.kind for p in present}
        if len(kinds) == 1:
            return GGUFLinear(
                _buffer([p.rows for p in present]),
                GGUF_KINDS[kinds.pop()],
                bias,
                int8_activations=int8_activations,
            )
        if kinds <= {"Q4_0", "Q4_1"}:
            return _int4_layer(present, bias, dtype)
        return linear

    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = from_file_type(attn.qkv_proj, f"{prefix}.self_attn.qkv_proj.weight")
        attn.o_proj = from_file_type(attn.o_proj, f"{prefix}.self_attn.o_proj.weight")
        mlp.gate_up_proj = from_file_type(mlp.gate_up_proj, f"{prefix}.mlp.gate_up_proj.weight")
        mlp.down_proj = from_file_type(mlp.down_proj, f"{prefix}.mlp.down_proj.weight")

    embedding_parts = found.get("embed_tokens.weight")
    if embedding_parts is None:
        quantize_output_and_embedding(model, Int8WeightOnlyLinear.from_float)
        return
    embedding = embedding_parts[0]
    table = GGUFEmbedding(_buffer([embedding.rows]), GGUF_KINDS[embedding.kind], dtype)
    if model.architecture.tie_word_embeddings:
        model.lm_head = GGUFLinear(
            table.blocks, table.kind, None, int8_activations=int8_activations
        )
    else:
        model.lm_head = from_file_type(model.lm_head, "lm_head.weight")
        if isinstance(model.lm_head, torch.nn.Linear):
            weight = model.lm_head.weight.data
            model.lm_head = Int8WeightOnlyLinear.from_float(weight, None)
    model.embed_tokens = table
