"""The names of the KV cache and weight formats, their validation, and what they resolve to.

--kv-cache-dtype  auto | float32 | bfloat16 | float16 | int8 (per-group scales,
                  --kv-cache-group-size); auto is the model dtype, but float16 under
                  --quantization gguf on a CPU (llama.cpp's default cache)
--quantization    none | int8 | w8a8 | int4 | nf4 | gguf | gguf-exact | auto
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from services.contracts.errors import LLMServeError

KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "int8"]
Quantization = Literal["none", "int8", "w8a8", "int4", "nf4", "gguf", "gguf-exact", "auto"]

KV_CACHE_DTYPES: tuple[KVCacheDType, ...] = ("auto", "float32", "bfloat16", "float16", "int8")
QUANTIZATIONS: tuple[Quantization, ...] = (
    "none",
    "int8",
    "w8a8",
    "int4",
    "nf4",
    "gguf",
    "gguf-exact",
    "auto",
)
QUANTIZATION_HELP = {
    "none": "float weights in the model dtype",
    "int8": "int8 weight-only, one scale per output channel",
    "w8a8": "int8 weights per channel, int8 activations per token (dynamic); o_proj stays float",
    "int4": "int4 weight-only, asymmetric, one scale and zero per group of 32 along K",
    "nf4": "4-bit normal-float codes, one absmax per group of 64 along K",
    "gguf": "keep a GGUF file's quantized blocks (Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ4_NL, IQ4_XS)"
    " as stored and compute on them with activations rounded to int8 per 32 values"
    " (llama.cpp's arithmetic); F16/F32/BF16 tensors and other kinds stay float",
    "gguf-exact": "a GGUF file's blocks as gguf, but fp32 activations multiply the file's"
    " exact weights in fp32 (parity with transformers; slower)",
    "auto": "the model file's own format: a GGUF file as gguf, a Hugging Face directory in its"
    " dtype (as none)",
}
INT4_GROUP_SIZE = 32
NF4_GROUP_SIZE = 64
# fp16 scales: 2 bytes per group instead of 4, and the range of |K|, |V| / 127 fits fp16.
KV_SCALE_DTYPE = torch.float16


class InvalidFormatError(LLMServeError, ValueError):
    """A format flag has a value we do not serve; the message names the flag."""


def check_kv_cache_dtype(value: str) -> KVCacheDType:
    if value not in KV_CACHE_DTYPES:
        raise InvalidFormatError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {value!r}"
        )
    return value  # type: ignore[return-value]


def check_kv_cache_group_size(value: int) -> int:
    if value < 1 or value & (value - 1):
        raise InvalidFormatError(f"--kv-cache-group-size must be a power of two; got {value}")
    return value


def check_quantization(value: str) -> Quantization:
    if value not in QUANTIZATIONS:
        raise InvalidFormatError(
            f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {value!r}"
        )
    return value  # type: ignore[return-value]


def resolve_quantization(value: str, path: Path) -> Quantization:
    """The format a --quantization value serves for the model at `path` (auto -> gguf for a
    .gguf file, none otherwise; every other value is itself)."""
    quantization = check_quantization(value)
    if quantization == "auto":
        return "gguf" if path.suffix == ".gguf" else "none"
    return quantization


def serves_gguf_blocks(quantization: str, model: str | Path | None) -> bool:
    """Whether the model (a path, a name, None for the embedded one) is served from its GGUF
    blocks with this --quantization value."""
    from services.common.model_source import resolve_model_path

    path = resolve_model_path(None if model is None else str(model))
    return resolve_quantization(quantization, path) in ("gguf", "gguf-exact")


def kv_cache_torch_dtype(
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    *,
    quantization: str = "none",
    device: str = "cpu",
) -> torch.dtype:
    """The element type of the KV cache tensor for a --kv-cache-dtype value. `auto` is the
    model dtype, except under llama.cpp's arithmetic (`gguf`: int8 activations) on a CPU, where
    it is llama.cpp's default cache, float16: a float32 model's cache at half the bytes, which
    halves the memory per sequence and the bytes a decode step's attention reads (the step's
    largest cost after the matmuls at batch 16 and more). `gguf-exact` promises transformers'
    float32 arithmetic, so its cache is float32 whatever the model dtype (a float16 cache
    alone changes greedy tokens against the float32 reference)."""
    value = check_kv_cache_dtype(kv_cache_dtype)
    if value == "auto" and quantization == "gguf-exact":
        return torch.float32
    if value == "auto":
        llama_cpp_arithmetic = quantization == "gguf" and not device.startswith("cuda")
        if llama_cpp_arithmetic and model_dtype == torch.float32:
            return torch.float16
        return model_dtype
    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int8": torch.int8,
    }[value]
