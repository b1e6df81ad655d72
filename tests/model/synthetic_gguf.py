"""A Llama-shaped GGUF of any size, written directly with gguf-py in Q4_K_M's tensor types
(Q4_K projections, Q6_K for v and down, a tied Q6_K embedding): random block bytes whose fp16
scales are small and finite, so every weight is a finite number. For load tests that need real
sizes (memory, mapping), not real weights; llama.cpp's quantizer is not needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

BYTE_TOKENS = 257
# Offsets of the fp16 scale fields inside a block (gguf-py's and llama.cpp's layouts):
# Q4_K: d, dmin first; Q6_K: d last.
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def _blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    per_row = cols // values
    data = np.frombuffer(rng.bytes(rows * per_row * size), np.uint8).reshape(rows * per_row, size)
    data = data.copy()
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    for offset in _SCALE_OFFSETS[kind]:
        data[:, offset : offset + 2] = scale
    return data.reshape(rows, per_row * size)


def write_llama_q4_k_m(
    path: Path,
    *,
    hidden: int = 2048,
    ffn: int = 8192,
    num_layers: int = 2,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    seed: int = 0,
) -> Path:
    """A Llama GGUF of these dimensions with a byte-level vocabulary of 257 tokens."""
    import gguf
    from gguf import GGMLQuantizationType
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("synthetic llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(hidden // num_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt"]
    assert len(tokens) == BYTE_TOKENS
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t"])
    writer.add_token_types([1] * len(tokens))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        writer.add_tensor(
            name, _blocks(rng, kind, rows, cols), raw_dtype=GGMLQuantizationType[kind]
        )

    head_dim = hidden // num_heads
    matrix("token_embd.weight", BYTE_TOKENS, hidden, "Q6_K")
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(num_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden, "Q4_K")
        matrix(f"blk.{i}.attn_k.weight", num_kv_heads * head_dim, hidden, "Q4_K")
        matrix(f"blk.{i}.attn_v.weight", num_kv_heads * head_dim, hidden, "Q6_K")
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden, "Q4_K")
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden, "Q4_K")
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden, "Q4_K")
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn, "Q6_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
