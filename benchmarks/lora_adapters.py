"""Random LoRA adapters of a GGUF model, written offline in PEFT's format (adapter_config.json
+ adapter_model.safetensors) without peft or the model's float weights: the shapes come from
the GGUF header. For `llmserve bench lora` and the stack tests; the parity tests make theirs
with peft itself."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(gguf_path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(number of layers, {module: (in_features, out_features)}) of a llama-like GGUF model."""
    from services.common.gguf_metadata import read_metadata

    meta = read_metadata(gguf_path)
    arch = meta["general.architecture"]
    hidden = int(meta[f"{arch}.embedding_length"])
    ffn = int(meta[f"{arch}.feed_forward_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, ffn),
        "up_proj": (hidden, ffn),
        "down_proj": (ffn, hidden),
    }
    return int(meta[f"{arch}.block_count"]), shapes


def write_random_adapter(
    directory: Path,
    gguf_path: Path,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets: Sequence[str] = ALL_LINEAR,
    seed: int = 0,
    b_scale: float = 0.02,
) -> Path:
    """A random adapter of the model at `gguf_path` in `directory`; A ~ N(0, 1/in), B ~
    N(0, b_scale) so its outputs differ from the base's and from other seeds'."""
    import torch
    from safetensors.torch import save_file

    num_layers, shapes = projection_shapes(gguf_path)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            in_features, out_features = shapes[module]
            group = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * b_scale
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": gguf_path.name,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory
