"""The worker service's configuration."""

from __future__ import annotations

from dataclasses import dataclass


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
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int | None = None
    """Longest prompt + output; unset = the model's context length."""
    seed: int | None = None
    """Seed of the sampler's shared generator."""
    threads: int | None = None
    """torch CPU threads; unset = one per core."""
    drain_s: float = 10.0
    """On SIGTERM, how long an in-flight step stream may take to finish."""
