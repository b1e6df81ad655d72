"""Quantized formats of the worker: the KV cache (int8 with group scales) and the weights
(int8, W8A8, int4, NF4, or a GGUF file's own blocks), applied at load by swapping layers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.worker.quantization.formats import resolve_quantization

if TYPE_CHECKING:  # the model imports the KV cache, which imports the format names from here
    from services.worker.model.causal_lm import CausalLM


def apply_quantization(model: CausalLM, quantization: str, path: Path) -> None:
    """Quantize a freshly loaded float model in place (`path`: the file it came from)."""
    quantization = resolve_quantization(quantization, path)
    if quantization == "none":
        return
    if quantization in ("gguf", "gguf-exact"):
        from services.worker.quantization.gguf_direct import load_gguf_quantized

        load_gguf_quantized(model, path, int8_activations=quantization == "gguf")
        return
    from services.worker.quantization.swap import quantize_model

    quantize_model(model, quantization)
