"""OLMo 2: norms on the attention and MLP outputs only (no pre-norms), and QK-norm across
the whole q and k projections."""

from __future__ import annotations

from typing import Any

from services.worker.model.architecture import ModelArchitecture
from services.worker.model.families.base import (
    ATTN_OUT_NORM,
    MLP_OUT_NORM,
    GGUFMetadata,
    ModelFamily,
    gguf_architecture,
    hf_architecture,
)


def _olmo2_hf(config: dict[str, Any]) -> ModelArchitecture:
    return hf_architecture(
        "olmo2",
        config,
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm="across_heads",
        pre_norms=False,
        post_norms=True,
    )


def _olmo2_gguf(meta: GGUFMetadata) -> ModelArchitecture:
    return gguf_architecture(
        "olmo2", meta, qk_norm="across_heads", pre_norms=False, post_norms=True
    )


OLMO2 = ModelFamily(
    name="olmo2",
    hf_model_types=("olmo2",),
    gguf_architectures=("olmo2",),
    read_hf=_olmo2_hf,
    read_gguf=_olmo2_gguf,
    hf_norm_names={
        "post_attention_layernorm": ATTN_OUT_NORM,
        "post_feedforward_layernorm": MLP_OUT_NORM,
    },
)
