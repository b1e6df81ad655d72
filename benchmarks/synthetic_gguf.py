"""A Llama GGUF written directly as Q4_K_M with random blocks: the shape of a model too large
to build through transformers in this machine's memory (Llama 3.1 8B: 16 GB in bf16, twice that
while saving), with the tensor names, metadata and per-tensor types llama-quantize gives it.

Which type each tensor gets is llama.cpp's rule for Q4_K_M (src/llama-quant.cpp,
llama_tensor_get_type_impl), for a dense model without experts:

    output.weight (and token_embd when tied)   Q6_K
    token_embd.weight (untied)                 Q4_K
    blk.N.attn_v, blk.N.ffn_down               Q6_K where use_more_bits(N, layers), else Q4_K
    the other matrices                         Q4_K
    norms, rope_freqs (1-D)                    F32

    use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2    (half the layers)

Blocks are random bytes with their fp16 scales set to small finite values, so every weight
decodes to a finite number of about the size of a trained model's (|w| ~ 0.02): the model
answers nonsense at the real speed and memory. The file is written tensor by tensor; no more
than the largest tensor is in memory at once.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from benchmarks.model_shapes import ModelShape

QK_K = 256
Q4_K_BLOCK_BYTES = 144  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of 4-bit codes
Q6_K_BLOCK_BYTES = 210  # 128 low bits, 64 high bits, 16 int8 scales, d (fp16)
FILE_TYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
SEED = 0

# Block scales: a Q4_K weight is d * scale * q - dmin * min with scale, min in 0..63 and q in
# 0..15; a Q6_K weight d * scale * (q - 32) with scale in -32..31 here and q in 0..63. These
# d values put both at a standard deviation of about 0.02.
Q4_K_D = 1.0e-4
Q4_K_DMIN = 7.5e-4
Q6_K_D = 1.0e-4


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down keep more bits."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    rows: int
    cols: int
    """Values per row (GGUF's ne[0]); 1-D tensors have rows == 1."""
    type_name: str
    """'Q4_K', 'Q6_K' or 'F32'."""

    @property
    def nbytes(self) -> int:
        if self.type_name == "F32":
            return self.rows * self.cols * 4
        block = Q4_K_BLOCK_BYTES if self.type_name == "Q4_K" else Q6_K_BLOCK_BYTES
        return self.rows * (self.cols // QK_K) * block


def q4_k_m_type(name: str, num_layers: int, tied_embeddings: bool) -> str:
    """The type llama-quantize gives tensor `name` of a dense Llama-family model in Q4_K_M."""
    if not name.endswith(".weight") or "norm" in name or name == "rope_freqs.weight":
        return "F32"
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        return "Q6_K"
    if name.startswith("blk.") and name.endswith((".attn_v.weight", ".ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "Q6_K" if use_more_bits(layer, num_layers) else "Q4_K"
    return "Q4_K"


def llama_tensor_plan(shape: ModelShape) -> list[TensorPlan]:
    """Every tensor of a Llama-architecture GGUF in file order, with its Q4_K_M type."""
    hidden, layers = shape.hidden_size, shape.num_layers
    q_size = shape.num_heads * shape.head_dim
    kv_size = shape.num_kv_heads * shape.head_dim
    mlp = shape.intermediate_size
    # (name, rows, values per row)
    matrices: list[tuple[str, int, int]] = [
        ("token_embd.weight", shape.vocab_size, hidden),
        ("rope_freqs.weight", 1, shape.head_dim // 2),
    ]
    for layer in range(layers):
        block = f"blk.{layer}."
        matrices += [
            (block + "attn_norm.weight", 1, hidden),
            (block + "attn_q.weight", q_size, hidden),
            (block + "attn_k.weight", kv_size, hidden),
            (block + "attn_v.weight", kv_size, hidden),
            (block + "attn_output.weight", hidden, q_size),
            (block + "ffn_norm.weight", 1, hidden),
            (block + "ffn_gate.weight", mlp, hidden),
            (block + "ffn_up.weight", mlp, hidden),
            (block + "ffn_down.weight", hidden, mlp),
        ]
    matrices.append(("output_norm.weight", 1, hidden))
    if not shape.tied_embeddings:
        matrices.append(("output.weight", shape.vocab_size, hidden))
    plans = [
        TensorPlan(name, rows, cols, q4_k_m_type(name, layers, shape.tied_embeddings))
        for name, rows, cols in matrices
    ]
    for plan in plans:
        if plan.type_name != "F32" and plan.cols % QK_K:
            raise ValueError(f"{plan.name}: {plan.cols} values per row is not a multiple of 256")
    return plans


def llama3_rope_factors(shape: ModelShape) -> np.ndarray:
    """rope_freqs.weight: Llama 3's frequency scaling, as convert_hf_to_gguf.py computes it."""
    rope = shape.config["rope_parameters"]
    base, dim = float(rope["rope_theta"]), shape.head_dim
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_blocks(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes, (rows, bytes per row): random codes, finite small fp16 scales."""
    per_row = plan.nbytes // plan.rows
    data = np.frombuffer(bytearray(rng.bytes(plan.nbytes)), dtype=np.uint8)
    block_bytes = Q4_K_BLOCK_BYTES if plan.type_name == "Q4_K" else Q6_K_BLOCK_BYTES
    blocks = data.reshape(-1, block_bytes)
    jitter = (0.5 + rng.random(len(blocks), dtype=np.float32)).astype(np.float32)
    if plan.type_name == "Q4_K":
        blocks[:, 0:2] = (Q4_K_D * jitter).astype(np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = (Q4_K_DMIN * jitter).astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:
        scales = blocks[:, 192:208]
        blocks[:, 192:208] = ((scales & 0x3F).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = (Q6_K_D * jitter).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(plan.rows, per_row)


def tensor_data(plan: TensorPlan, shape: ModelShape, rng: np.random.Generator) -> np.ndarray:
    if plan.name == "rope_freqs.weight":
        return llama3_rope_factors(shape)
    if plan.type_name == "F32":  # norms: ones, as a trained model's are near
        return np.ones(plan.cols, dtype=np.float32)
    return random_blocks(plan, rng)


def embedded_tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of the embedded model's tokenizer.* metadata."""
    from gguf import GGUFReader, GGUFValueType

    from services.common.model_source import embedded_model_path

    reader = GGUFReader(str(embedded_model_path()))
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[1] if main == GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), main, sub))
    return fields


def write_q4_k_m(shape: ModelShape, path: Path, seed: int = SEED) -> None:
    """The Llama shape `shape` as a Q4_K_M GGUF at `path`, tensor by tensor."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from tqdm import tqdm  # type: ignore[import-untyped]

    if shape.config_class != "LlamaConfig":
        raise ValueError(f"{shape.name}: only Llama shapes are written directly")
    plans = llama_tensor_plan(shape)
    writer = GGUFWriter(str(path), "llama")
    writer.add_type("model")
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_context_length(int(shape.config["max_position_embeddings"]))
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(float(shape.config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(shape.config["rms_norm_eps"]))
    writer.add_file_type(FILE_TYPE_Q4_K_M)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_rope_dimension_count(shape.head_dim)
    for key, value, value_type, item_type in embedded_tokenizer_fields():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    writer.add_quantization_version(2)
    for plan in plans:
        if plan.type_name == "F32":
            writer.add_tensor_info(plan.name, (plan.cols,), np.dtype(np.float32), plan.nbytes)
        else:
            byte_shape = (plan.rows, plan.nbytes // plan.rows)
            raw = GGMLQuantizationType[plan.type_name]
            writer.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8), plan.nbytes, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(plan.nbytes for plan in plans)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"  {path.name}", file=sys.stdout
    ) as bar:
        for plan in plans:
            writer.write_tensor_data(tensor_data(plan, shape, rng))
            bar.update(plan.nbytes)
    writer.close()
