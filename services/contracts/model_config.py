"""The architecture of a Llama-family model (the model facts every service agrees on), read
from a HF config.json or GGUF metadata without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError
from services.common.gguf_metadata import field_value, open_gguf

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
    layer_sliding_windows: tuple[int, ...] = ()
    """Per layer, its sliding window in tokens (0: full attention); empty: no layer has one."""

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


def read_model_config(path: Path) -> ModelConfig:
    """The config of a .gguf file (its metadata) or a Hugging Face directory (config.json)."""
    if path.suffix == ".gguf":
        return gguf_model_config(open_gguf(path))
    return hf_model_config(path)


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )

    def meta(name: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{name}", default)

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = int(meta("vocab_size", len(tokens.data) if tokens is not None else 0))
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=str(arch),
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )


def hf_model_config(directory: Path) -> ModelConfig:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    model_config = ModelConfig.from_hf(config)
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            merged = tuple(dict.fromkeys((*model_config.eos_token_ids, *extra)))
            model_config = replace(model_config, eos_token_ids=merged)
    return model_config
