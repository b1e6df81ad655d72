"""Phi-3 and Phi-4(-mini): fused qkv_proj and gate_up_proj tensors, LongRoPE (short and long
factors), and a partial rotary on Phi-4-mini."""

from __future__ import annotations

from typing import Any

from services.worker.model.architecture import ModelArchitecture, RopeConfig
from services.worker.model.families.base import (
    GGUFMetadata,
    ModelFamily,
    gguf_architecture,
    gguf_rope,
    hf_architecture,
)


def _phi3_hf(config: dict[str, Any]) -> ModelArchitecture:
    window = config.get("sliding_window")
    num_layers = int(config["num_hidden_layers"])
    windows = (int(window),) * num_layers if window else ()
    return hf_architecture("phi3", config, layer_sliding_windows=windows)


def _phi3_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    num_heads = int(meta.require("attention.head_count"))
    head_dim = int(meta.require("embedding_length")) // num_heads
    rope = gguf_rope(meta, head_dim)
    long = meta.tensor_values("rope_factors_long.weight")
    short = meta.tensor_values("rope_factors_short.weight")
    if long is not None and short is not None:
        original = int(meta.get("rope.scaling.original_context_length", 4096))
        scaling = {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": original,
            "max_position_embeddings": int(meta.get("context_length", original)),
            "attention_factor": meta.get("rope.scaling.attn_factor"),
        }
        rope = RopeConfig(rope.theta, scaling, rope.partial_rotary_factor)
    # llama.cpp reads a window only from files that mark it, and Phi-3 files do not.
    return gguf_architecture("phi3", meta, rope=rope)


PHI3 = ModelFamily(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    read_hf=_phi3_hf,
    read_gguf=_phi3_gguf,
    gguf_fused_gate_up=True,
)
