"""The worker service's configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.quantization.formats import (
    DEFAULT_KV_GROUP_SIZE,
    check_kv_cache_dtype,
    check_kv_cache_group_size,
    check_quantization,
)

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 50070
    """Port of the Worker service (0 = any free port)."""
    model: str | None = None
    """A .gguf file or Hugging Face directory; unset = the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16 (auto: bfloat16 where the CPU has native bf16)."""
    device: str = "cpu"
    """cpu or cuda[:N]."""
    kv_cache_gib: float = 1.0
    """Memory for the paged KV cache, GiB; the number of blocks follows."""
    kv_cache_dtype: str = "auto"
    """auto (the model dtype) or int8 (per-group fp16 scales; about 1.6x the blocks of bf16)."""
    kv_cache_group_size: int = DEFAULT_KV_GROUP_SIZE
    """int8 KV cache: values of head_dim sharing one scale (8: 1.25 B/value, 64: 1.03)."""
    quantization: str = "auto"
    """Weights: auto (a GGUF keeps its own Q4/Q8 blocks, a HF directory its dtype), none, int8,
    w8a8, int4, nf4, or gguf."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int | None = None
    """Longest prompt + output; unset = the model's context length."""
    seed: int | None = None
    """Seed of the sampler's shared generator."""
    threads: int | None = None
    """torch CPU threads; unset = one per core."""
    max_num_seqs: int = 128
    """Largest decode batch that replays a compiled step graph (the scheduler's
    --max-num-seqs); larger batches run eagerly."""
    enforce_eager: bool = False
    """Run every step eagerly (no compiled step graphs): slower, starts faster."""
    fused_decode: bool = True
    """Pure-decode steps of a float32 GGUF model run every layer in one C++ call (no
    compilation needed); --no-fused-decode uses compiled graphs or eager ops instead."""
    drain_s: float = 10.0
    """On SIGTERM, how long an in-flight step stream may take to finish."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics HTTP endpoint (0 = any free port); unset = none."""

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_cache_group_size(self.kv_cache_group_size)
        check_quantization(self.quantization)


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        if device.startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]
