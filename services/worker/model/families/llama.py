"""The Llama family and its close kin: Llama 2/3.x, SmolLM2, Mistral (one window on every
layer), Granite (multipliers on embeddings, residuals, queries and logits) and SmolLM3 (no
rope on every fourth layer)."""

from __future__ import annotations

from typing import Any

from services.worker.model.architecture import ModelArchitecture
from services.worker.model.families.base import (
    GGUFMetadata,
    ModelFamily,
    gguf_architecture,
    gguf_windowed_reader,
    hf_architecture,
)


def _all_layers(config: dict[str, Any]) -> tuple[int, ...]:
    window = config.get("sliding_window")
    return (int(window),) * int(config["num_hidden_layers"]) if window else ()


def _llama_hf(config: dict[str, Any]) -> ModelArchitecture:
    return hf_architecture(
        "llama",
        config,
        attention_bias=bool(config.get("attention_bias", False)),
    )


LLAMA = ModelFamily(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    read_hf=_llama_hf,
    read_gguf=gguf_windowed_reader("llama"),
    gguf_permuted_qk=True,
)


def _mistral_hf(config: dict[str, Any]) -> ModelArchitecture:
    return hf_architecture("mistral", config, layer_sliding_windows=_all_layers(config))


MISTRAL = ModelFamily(
    name="mistral",
    hf_model_types=("mistral",),
    gguf_architectures=("mistral",),
    read_hf=_mistral_hf,
    read_gguf=gguf_windowed_reader("mistral"),
    gguf_permuted_qk=True,
)


def _granite_hf(config: dict[str, Any]) -> ModelArchitecture:
    return hf_architecture(
        "granite",
        config,
        attention_bias=bool(config.get("attention_bias", False)),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        attention_scale=float(config.get("attention_multiplier", 1.0)),
        logits_divisor=float(config.get("logits_scaling", 1.0)),
    )


def _granite_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    return gguf_architecture(
        "granite",
        meta,
        embedding_multiplier=float(meta.get("embedding_scale", 1.0)),
        residual_multiplier=float(meta.get("residual_scale", 1.0)),
        attention_scale=float(meta.get("attention.scale", 1.0)),
        logits_divisor=float(meta.get("logit_scale", 1.0)),
    )


GRANITE = ModelFamily(
    name="granite",
    hf_model_types=("granite",),
    gguf_architectures=("granite",),
    read_hf=_granite_hf,
    read_gguf=_granite_gguf,
    gguf_permuted_qk=True,
)


def _smollm3_rope_layers(config: dict[str, Any]) -> tuple[bool, ...]:
    num_layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    return tuple(bool(f) for f in flags)


def _smollm3_hf(config: dict[str, Any]) -> ModelArchitecture:
    uses_rope = _smollm3_rope_layers(config)
    windows: tuple[int, ...] = ()
    window = config.get("sliding_window")
    if config.get("use_sliding_window") and window:
        types = config.get("layer_types") or [
            "full_attention" if rope else "sliding_attention" for rope in uses_rope
        ]
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return hf_architecture(
        "smollm3",
        config,
        attention_bias=bool(config.get("attention_bias", False)),
        layer_uses_rope=uses_rope,
        layer_sliding_windows=windows if any(windows) else (),
    )


def _smollm3_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    # llama.cpp's SmolLM3 skips rope on every fourth layer (its n_no_rope_layer_step).
    num_layers = int(meta.require("block_count"))
    step = int(meta.get("no_rope_layer_step", 4))
    uses_rope = tuple((i + 1) % step != 0 for i in range(num_layers))
    return gguf_architecture("smollm3", meta, layer_uses_rope=uses_rope)


SMOLLM3 = ModelFamily(
    name="smollm3",
    hf_model_types=("smollm3",),
    gguf_architectures=("smollm3",),
    read_hf=_smollm3_hf,
    read_gguf=_smollm3_gguf,
    gguf_permuted_qk=True,
)
