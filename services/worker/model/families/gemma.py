"""Gemma 1/2/3: RMSNorm with (1 + w), embeddings scaled by sqrt(hidden), GELU-tanh gating,
tied embeddings. Gemma 2 adds post-norms, alternating sliding-window layers and soft-capped
attention and final logits; Gemma 3 replaces the caps with per-head QK-norm, windows five
layers of six and gives windowed layers their own rope base."""

from __future__ import annotations

import math
from typing import Any

from services.contracts.errors import ModelLoadError
from services.worker.model.architecture import ModelArchitecture, RopeConfig
from services.worker.model.families.base import (
    ATTN_NORM,
    ATTN_OUT_NORM,
    MLP_NORM,
    MLP_OUT_NORM,
    GGUFMetadata,
    ModelFamily,
    gguf_architecture,
    gguf_swa_windows,
    hf_architecture,
    hf_layer_windows,
)

_SANDWICH_NORM_NAMES = {
    "input_layernorm": ATTN_NORM,
    "post_attention_layernorm": ATTN_OUT_NORM,
    "pre_feedforward_layernorm": MLP_NORM,
    "post_feedforward_layernorm": MLP_OUT_NORM,
}
_GEMMA3_LOCAL_THETA = 10000.0


def _act(config: dict[str, Any]) -> str:
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        raise ModelLoadError(f"Gemma activation {act!r} is not supported (gelu_pytorch_tanh)")
    # Gemma 1 configs say "gelu" but its reference code and transformers use the tanh form.
    return "gelu_tanh"


def _scale(config: dict[str, Any]) -> float | None:
    scalar = config.get("query_pre_attn_scalar")
    return float(scalar) ** -0.5 if scalar else None


def _cap(value: Any) -> float:
    return float(value) if value else 0.0


def _common(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _act(config),
        "embedding_multiplier": float(config["hidden_size"]) ** 0.5,
    }


def _gemma_hf(config: dict[str, Any]) -> ModelArchitecture:
    config = {"tie_word_embeddings": True, **config}
    return hf_architecture("gemma", config, **_common(config))


def _gemma2_hf(config: dict[str, Any]) -> ModelArchitecture:
    config = {"tie_word_embeddings": True, **config}
    return hf_architecture(
        "gemma2",
        config,
        **_common(config),
        post_norms=True,
        attention_scale=_scale(config),
        attn_logit_softcap=_cap(config.get("attn_logit_softcapping")),
        final_logit_softcap=_cap(config.get("final_logit_softcapping")),
        layer_sliding_windows=hf_layer_windows(
            config, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention"
        ),
    )


def _gemma3_hf(config: dict[str, Any]) -> ModelArchitecture:
    config = {"tie_word_embeddings": True, **config}
    period = int(config.get("sliding_window_pattern", 6))
    switches: dict[str, Any] = {}
    local_theta = config.get("rope_local_base_freq")
    if local_theta is not None and "full_attention" not in (config.get("rope_parameters") or {}):
        # Hub configs: one rope_theta (+ rope_scaling) for global layers, a plain base for
        # local ones.
        switches["local_rope"] = RopeConfig(theta=float(local_theta))
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention is not supported")
    return hf_architecture(
        "gemma3",
        config,
        **_common(config),
        **switches,
        post_norms=True,
        qk_norm="per_head",
        attention_scale=_scale(config),
        attn_logit_softcap=_cap(config.get("attn_logit_softcapping")),
        final_logit_softcap=_cap(config.get("final_logit_softcapping")),
        layer_sliding_windows=hf_layer_windows(
            config,
            lambda i: "sliding_attention" if (i + 1) % period else "full_attention",
        ),
    )


def _gemma_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    hidden = float(meta.require("embedding_length"))
    return gguf_architecture(
        "gemma", meta, hidden_act="gelu_tanh", embedding_multiplier=hidden**0.5
    )


def _gemma2_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    hidden = float(meta.require("embedding_length"))
    num_layers = int(meta.require("block_count"))
    windows = gguf_swa_windows(meta, num_layers, 2)
    if not windows:
        windows = tuple(4096 if i % 2 == 0 else 0 for i in range(num_layers))
    return gguf_architecture(
        "gemma2",
        meta,
        hidden_act="gelu_tanh",
        embedding_multiplier=hidden**0.5,
        post_norms=True,
        attention_scale=_gguf_query_scale(meta),
        attn_logit_softcap=_cap(meta.get("attn_logit_softcapping")),
        final_logit_softcap=_cap(meta.get("final_logit_softcapping")),
        layer_sliding_windows=windows,
    )


def _gemma3_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    hidden = float(meta.require("embedding_length"))
    num_layers = int(meta.require("block_count"))
    windows = gguf_swa_windows(meta, num_layers, 6)
    local_theta = float(meta.get("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    return gguf_architecture(
        "gemma3",
        meta,
        hidden_act="gelu_tanh",
        embedding_multiplier=hidden**0.5,
        post_norms=True,
        qk_norm="per_head",
        attention_scale=_gguf_query_scale(meta),
        final_logit_softcap=_cap(meta.get("final_logit_softcapping")),
        layer_sliding_windows=windows,
        local_rope=RopeConfig(theta=local_theta) if windows else None,
    )


def _gguf_query_scale(meta: GGUFMetadata) -> float | None:
    # GGUF keeps no query_pre_attn_scalar: llama.cpp takes head_dim, except for the 27B
    # models (hidden / heads), which it recognises by their layer count.
    scale = meta.get("attention.scale")
    if scale is not None:
        return float(scale)
    num_layers = int(meta.require("block_count"))
    if (meta.architecture, num_layers) in (("gemma2", 46), ("gemma3", 62)):
        hidden = int(meta.require("embedding_length"))
        head_dim_of_27b = hidden // int(meta.require("attention.head_count"))
        return 1.0 / math.sqrt(head_dim_of_27b)
    return None


GEMMA = ModelFamily(
    name="gemma",
    hf_model_types=("gemma",),
    gguf_architectures=("gemma",),
    read_hf=_gemma_hf,
    read_gguf=_gemma_gguf,
    hf_norm_offset=1.0,
)

GEMMA2 = ModelFamily(
    name="gemma2",
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    read_hf=_gemma2_hf,
    read_gguf=_gemma2_gguf,
    hf_norm_names=dict(_SANDWICH_NORM_NAMES),
    hf_norm_offset=1.0,
)

GEMMA3 = ModelFamily(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    read_hf=_gemma3_hf,
    read_gguf=_gemma3_gguf,
    hf_norm_names=dict(_SANDWICH_NORM_NAMES),
    hf_norm_offset=1.0,
)
