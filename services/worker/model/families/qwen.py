"""Qwen2 (biases on q/k/v) and Qwen3 (per-head QK-norm, no biases). Both may window the
layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from services.worker.model.architecture import ModelArchitecture
from services.worker.model.families.base import (
    ModelFamily,
    gguf_windowed_reader,
    hf_architecture,
    hf_layer_windows,
)


def _windows(config: dict[str, Any]) -> tuple[int, ...]:
    if not config.get("use_sliding_window"):
        return ()
    first_windowed = int(config.get("max_window_layers", 0))
    return hf_layer_windows(
        config,
        lambda i: "sliding_attention" if i >= first_windowed else "full_attention",
    )


def _qwen2_hf(config: dict[str, Any]) -> ModelArchitecture:
    return hf_architecture(
        "qwen2",
        config,
        attention_bias=bool(config.get("attention_bias", True)),
        layer_sliding_windows=_windows(config),
    )


def _qwen3_hf(config: dict[str, Any]) -> ModelArchitecture:
    return hf_architecture(
        "qwen3",
        config,
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm="per_head",
        layer_sliding_windows=_windows(config),
    )


QWEN2 = ModelFamily(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    read_hf=_qwen2_hf,
    read_gguf=gguf_windowed_reader("qwen2"),
)

QWEN3 = ModelFamily(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    read_hf=_qwen3_hf,
    read_gguf=gguf_windowed_reader("qwen3", qk_norm="per_head"),
)
