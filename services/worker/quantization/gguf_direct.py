"""Serve a GGUF file's quantized tensors as the file stores them: every kind the kernels read
(kernels/gguf_blocks_torch.GGUF_KINDS: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL,
IQ4_XS) is kept byte for byte and read by the GGUF kernels (kernels/csrc/gguf_gemm.cpp), so
the weights in memory are the file's and nothing is rounded a second time.

    tensors of a layer                       becomes
    parts of one kind                        GGUFLinear over the parts' block rows, stacked
    parts of different kinds (Q4_K_M's       GGUFLinear over one tensor per part: their
      q|k|v, say)                            outputs side by side, activations rounded once
    any part of another kind (F16, F32,      stays as the float loader made it
      BF16, IQ2/IQ3 ...)

A fused layer (q|k|v, gate|up) stacks its parts' block rows: rows are independent, and the
q/k row order fix of the float loader (`unpermute_rows`) moves whole block rows. A quantized
token_embd becomes a GGUFEmbedding and, in a tied model, the output layer is a GGUFLinear over
the same buffer (one copy). Otherwise the embedding and output layer become int8 per row, as
for the other formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kernels import ops
from kernels.gguf_blocks_torch import GGUF_KINDS
from services.common.gguf_metadata import open_gguf
from services.worker.loader.gguf_loader import qk_heads, unpermute_rows
from services.worker.loader.weight_names import gguf_part
from services.worker.model.causal_lm import CausalLM
from services.worker.model.families import gguf_model_architecture
from services.worker.quantization.formats import InvalidFormatError
from services.worker.quantization.gguf_linear import GGUFEmbedding, GGUFLinear
from services.worker.quantization.linear import Int8WeightOnlyLinear
from services.worker.quantization.swap import quantize_output_and_embedding


@dataclass(frozen=True, slots=True)
class BlockRows:
    """One tensor as the file stores it: `rows` uint8 [N, K / 32 * block bytes]."""

    kind: str
    rows: np.ndarray


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


def _runs_of_one_kind(parts: list[BlockRows]) -> list[list[BlockRows]]:
    """Consecutive parts of the same kind, grouped (each group becomes one block tensor)."""
    runs: list[list[BlockRows]] = []
    for part in parts:
        if runs and runs[-1][0].kind == part.kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def load_gguf_quantized(model: CausalLM, path: Path, *, int8_activations: bool = True) -> None:
    """Swap `model`'s (float, already loaded) layers for the file's own quantized tensors;
    `int8_activations`: their products round activations to int8 blocks at every dtype
    (llama.cpp's arithmetic); otherwise fp32 activations get the exact product."""
    if path.suffix != ".gguf":
        raise InvalidFormatError(f"--quantization gguf needs a .gguf model, got {path}")
    found = read_block_rows(open_gguf(path))
    dtype = model.norm.dtype

    def _layout(blocks: Tensor, kind: int) -> tuple[Tensor, int]:
        # The int8 kernels' own layout where they have one (the same bytes, regrouped); the
        # exact path reads the file's.
        return ops.gguf_kernel_layout(blocks, kind) if int8_activations else (blocks, kind)

    def from_file_type(linear: torch.nn.Module, name: str) -> torch.nn.Module:
        assert isinstance(linear, torch.nn.Linear)
        bias = None if linear.bias is None else linear.bias.data
        present = found.get(name)
        if present is None:
            return linear
        stored = [
            _layout(_buffer([p.rows for p in run]), GGUF_KINDS[run[0].kind])
            for run in _runs_of_one_kind(present)
        ]
        return GGUFLinear(
            [blocks for blocks, _ in stored],
            [kind for _, kind in stored],
            bias,
            int8_activations=int8_activations,
        )

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
    table = GGUFEmbedding(*_layout(_buffer([embedding.rows]), GGUF_KINDS[embedding.kind]), dtype)
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
