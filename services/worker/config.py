"""The worker service's configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.serving_config import SERVICE_GROUPS
from services.worker.kv_transfer_shm import DEFAULT_DIRECTORY
from services.worker.quantization.formats import (
    check_kv_cache_dtype,
    check_kv_cache_group_size,
    check_quantization,
)

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class WorkerConfig(*SERVICE_GROUPS["worker"]):  # type: ignore[misc]
    """The shared groups (services.common.serving_config) plus what only the worker has. Of
    the batching group the worker reads max_num_seqs (its largest compiled step graph)."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback: only this machine's scheduler may reach it; 0.0.0.0 in
    a container, behind the stack's network and its internal secret)."""
    port: int = 50070
    """Port of the Worker service (0 = any free port)."""
    kv_transfer_shm_dir: str = DEFAULT_DIRECTORY
    """Shared-memory directory through which KV moves between two workers of one host
    (docs/disaggregation.md, Transport); empty = always the gRPC byte stream."""
    threads: int | None = None
    """torch CPU threads; unset = one per core."""
    drain_s: float = 10.0
    """On SIGTERM, how long an in-flight step stream may take to finish."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics HTTP endpoint (0 = any free port); unset = none."""

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_cache_group_size(self.kv_cache_group_size)
        check_quantization(self.quantization)
        self.check_speculation()
        self.check_lora()
        self.check_kv_tiers(self.device)


def resolve_dtype(name: str, device: str, *, gguf_blocks: bool = False) -> torch.dtype:
    """The compute dtype of a --dtype value. `auto`: bf16 on a GPU; on a CPU float32 for a
    model served from GGUF blocks (its decode steps run the fused C++ step, whose matmuls
    round activations to int8 whatever the dtype, so bf16 would save nothing), and for a dense
    model whichever of float32 and bf16 multiplies faster on this CPU, measured once per
    machine (services/worker/dtype_choice.py)."""
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        if gguf_blocks:
            return torch.float32
        from services.worker.dtype_choice import measured_cpu_dtype

        return measured_cpu_dtype()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]
