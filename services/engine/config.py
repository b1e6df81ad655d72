"""The in-process engine's configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.serving_config import (
    BatchingConfig,
    ChatConfig,
    DebugConfig,
    DeviceConfig,
    ModelConfig,
    RuntimeConfig,
    SpeculationConfig,
    WeightsConfig,
)
from services.scheduler.config import AllocationPolicy
from services.worker.config import GiB


@dataclass(frozen=True, slots=True)
class EngineConfig(
    ModelConfig,
    ChatConfig,
    WeightsConfig,
    BatchingConfig,
    RuntimeConfig,
    SpeculationConfig,
    DebugConfig,
):
    """The worker's and the scheduler's shared groups (services.common.serving_config), plus
    what only the in-process engine has. quantization is ignored when a loaded model is
    given."""

    device: str = DeviceConfig.device
    """cpu or cuda[:N]."""
    kv_cache_bytes: int = int(DeviceConfig.kv_cache_gib * GiB)
    """Memory for the paged KV cache; the number of blocks follows from it."""
    allocation_policy: AllocationPolicy = "paged"
    """"max_length" reserves each request's worst case up front (for comparison only)."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None = torch's default (one per core)."""

    def __post_init__(self) -> None:
        from services.worker.quantization.formats import (
            check_kv_cache_dtype,
            check_kv_cache_group_size,
            check_quantization,
        )

        check_kv_cache_dtype(self.kv_cache_dtype)
        check_kv_cache_group_size(self.kv_cache_group_size)
        check_quantization(self.quantization)
        self.check_speculation()
