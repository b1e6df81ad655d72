"""The in-process engine's configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.worker.config import GiB

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None
    """A .gguf file or a Hugging Face directory; None = the embedded SmolLM2-135M-Instruct."""
    dtype: DTypeName = "auto"
    """Weights and activations. auto: bfloat16 where the CPU has native bf16 (or on CUDA)."""
    device: str = "cpu"
    kv_cache_bytes: int = 1 * GiB
    """Memory for the paged KV cache; the number of blocks follows from it."""
    kv_cache_dtype: str = "auto"
    """auto (the model dtype) or int8 (per-group scales: more blocks in the same bytes)."""
    kv_cache_group_size: int = 8
    """int8 KV cache: values of head_dim sharing one fp16 scale."""
    quantization: str = "auto"
    """Weights: auto (a GGUF keeps its own Q4/Q8 blocks, a HF directory its dtype), none,
    int8, w8a8, int4, nf4 or gguf (ignored when a loaded model is given)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int | None = None
    """Longest prompt + output; None = the model's context length."""
    max_num_seqs: int = 128
    """Most sequences in one step."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step (prefill chunks + decodes)."""
    enable_prefix_caching: bool = True
    allocation_policy: Literal["paged", "max_length"] = "paged"
    """"max_length" reserves each request's worst case up front (for comparison only)."""
    max_waiting_requests: int = 1024
    seed: int | None = None
    """Seed of the sampler's shared generator (requests without their own seed)."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None = torch's default (one per core)."""
    enforce_eager: bool = False
    """Run every step eagerly (no compiled step graphs): slower, starts faster."""
    fused_decode: bool = True
    """Pure-decode steps of a float32 GGUF model run every layer in one C++ call (no
    compilation needed); --no-fused-decode uses compiled graphs or eager ops instead."""

    def __post_init__(self) -> None:
        from services.worker.quantization.formats import (
            check_kv_cache_dtype,
            check_kv_cache_group_size,
            check_quantization,
        )

        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_cache_group_size(self.kv_cache_group_size)
        check_quantization(self.quantization)
