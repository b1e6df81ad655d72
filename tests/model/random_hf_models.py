"""Tiny random models of every registered family, saved as Hugging Face directories with
transformers' own config and model classes: the family's real switches on (windows smaller
than the test prompts, soft-caps, QK-norm, rope scalings, post-norms, multipliers), weights
spread wide enough that greedy choices are not ties. The vocabulary is the embedded model's
(its tokenizer.json is copied in), so the directories serve end to end as any user's would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.model_source import embedded_model_path
from services.text.model_tokenizer import ModelTokenizer

VOCAB_SIZE = 49152  # the embedded model's
WINDOW = 32
BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class FamilySpec:
    config_class: str
    overrides: dict[str, Any] = field(default_factory=dict)
    norm_offset: float = 0.0
    """Gemma stores norm weights as w in 1 + w: perturb around 0 instead of 1."""


FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama3": FamilySpec(
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-yarn": FamilySpec(
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "mistral": FamilySpec("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": FamilySpec("Qwen2Config"),
    "qwen2-window": FamilySpec(
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": FamilySpec("Qwen3Config", {"head_dim": 24}),
    "gemma": FamilySpec("GemmaConfig", {"head_dim": 16}, norm_offset=-1.0),
    "gemma2": FamilySpec(
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "num_hidden_layers": 4,
        },
        norm_offset=-1.0,
    ),
    "gemma3": FamilySpec(
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 6,
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        norm_offset=-1.0,
    ),
    "phi3": FamilySpec(
        "Phi3Config",
        {
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "phi4-mini": FamilySpec(
        "Phi3Config", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}
    ),
    "granite": FamilySpec(
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    ),
    "smollm3": FamilySpec("SmolLM3Config", {"num_hidden_layers": 4}),
    "olmo2": FamilySpec("Olmo2Config"),
}


def build_random_hf_model(name: str, directory: Path, seed: int = 0) -> Path:
    """Save family `name`'s tiny random model (float32 safetensors) with a tokenizer."""
    import transformers

    spec = FAMILY_SPECS[name]
    config = getattr(transformers, spec.config_class)(**{**BASE, **spec.overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + spec.norm_offset + 0.3 * torch.randn_like(param))
            elif param_name.endswith(".bias"):
                param.normal_(std=0.1)
    model.save_pretrained(directory)
    tokenizer = ModelTokenizer.from_path(embedded_model_path())
    tokenizer.tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def load_hf_reference(directory: Path):  # type: ignore[no-untyped-def]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model
