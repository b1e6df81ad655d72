"""The architecture of a Llama-family model, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    """Qwen2 has biases on q/k/v projections."""
    rope_scaling: dict[str, Any] | None = None
    """HF rope_scaling dict (type 'linear' or 'llama3'), None for plain RoPE."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = config.get("rope_scaling")
        rope_theta = config.get("rope_theta")
        # transformers 5 moved rope settings under rope_parameters.
        params = config.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            rope_scaling=rope_scaling,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
