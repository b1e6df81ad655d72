"""Keep a GGUF file's quantized tensors quantized: Q4_0 / Q4_1 blocks become our int4 layer
with the file's own codes and scales, Q8_0 becomes int8; nothing is re-rounded through
float except where noted.

    GGUF block (32 values)        -> our format (group 32 along K)
    Q4_1: d f16, m f16, 16 B      -> int4: code q, scale d, zero m + 8d      (exact up to the
                                     rounding of zero to the activation dtype)
    Q4_0: d f16, 16 B             -> int4: code q, scale d, zero 0            (exact)
    Q8_0: d f16, 32 x int8        -> int8 per output channel (re-quantized: our int8 kernel
                                     has one scale per row, not per 32 values)

A Q4 block stores value j in the low nibble of byte j and value j + 16 in its high nibble.
A fused layer (q|k|v, gate|up) is int4 when every part is Q4_0/Q4_1, int8 when every part is
Q8_0, and otherwise (float tensors, K-quants, a mix) stays as the float loader made it. The
output layer and the embedding become int8 per row (most small GGUFs store them as Q8_0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from services.worker.loader.gguf_loader import hf_tensor_name, open_gguf, unpermute_rows
from services.worker.model.llama import LlamaForCausalLM
from services.worker.quantization.formats import InvalidFormatError
from services.worker.quantization.linear import Int4Linear, Int8WeightOnlyLinear
from services.worker.quantization.swap import quantize_output_and_embedding

GGUF_BLOCK = 32


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """codes uint8 [N, K] in 0..15, scale and zero fp32 [N, K / 32]: W = (q - 8) s + z."""

    codes: Tensor
    scale: Tensor
    zero: Tensor

    def permute_rows(self, num_heads: int) -> Int4Codes:
        return Int4Codes(
            unpermute_rows(self.codes, num_heads),
            unpermute_rows(self.scale, num_heads),
            unpermute_rows(self.zero, num_heads),
        )


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


def _layer_int4_codes(
    reader: Any, num_heads: int, num_kv_heads: int
) -> tuple[dict[str, Int4Codes], dict[str, str]]:
    """(HF weight name -> its int4 codes for every Q4_0 / Q4_1 weight, name -> GGUF type)."""
    found: dict[str, Int4Codes] = {}
    kinds: dict[str, str] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        name = hf_tensor_name(tensor.name)
        kinds[name] = kind
        if kind not in ("Q4_0", "Q4_1"):
            continue
        rows = int(tensor.shape[-1])
        codes = decode_q4(np.asarray(tensor.data), rows, kind)
        # The same row order fix as the float loader (llama.cpp interleaves rotary halves).
        if name.endswith("q_proj.weight"):
            codes = codes.permute_rows(num_heads)
        elif name.endswith("k_proj.weight"):
            codes = codes.permute_rows(num_kv_heads)
        found[name] = codes
    return found, kinds


def _fused(parts: list[Int4Codes | None]) -> Int4Codes | None:
    if any(p is None for p in parts):
        return None
    present = [p for p in parts if p is not None]
    return Int4Codes(
        torch.cat([p.codes for p in present]),
        torch.cat([p.scale for p in present]),
        torch.cat([p.zero for p in present]),
    )


def load_gguf_quantized(model: LlamaForCausalLM, path: Path) -> None:
    """Swap `model`'s (float, already loaded) layers for the file's own quantized tensors."""
    if path.suffix != ".gguf":
        raise InvalidFormatError(f"--quantization gguf needs a .gguf model, got {path}")
    config = model.config
    if config.architecture not in ("llama", "mistral"):
        raise InvalidFormatError(
            f"--quantization gguf supports llama and mistral GGUF files, not {config.architecture}"
        )
    codes, kinds = _layer_int4_codes(open_gguf(path), config.num_heads, config.num_kv_heads)
    dtype = model.norm.dtype

    def from_file_type(linear: torch.nn.Module, parts: list[str]) -> torch.nn.Module:
        assert isinstance(linear, torch.nn.Linear)
        bias = None if linear.bias is None else linear.bias.data
        fused = _fused([codes.get(p) for p in parts])
        if fused is not None:
            return Int4Linear(fused.codes, fused.scale, fused.zero, bias, dtype)
        if all(kinds.get(p) == "Q8_0" for p in parts):
            return Int8WeightOnlyLinear.from_float(linear.weight.data, bias)
        return linear

    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = from_file_type(
            attn.qkv_proj, [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv"]
        )
        attn.o_proj = from_file_type(attn.o_proj, [f"{prefix}.self_attn.o_proj.weight"])
        mlp.gate_up_proj = from_file_type(
            mlp.gate_up_proj, [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up")]
        )
        mlp.down_proj = from_file_type(mlp.down_proj, [f"{prefix}.mlp.down_proj.weight"])
    # The embedding is Q8_0 in most small GGUFs: int8 per row (and shared with a tied head).
    quantize_output_and_embedding(model, Int8WeightOnlyLinear.from_float)
