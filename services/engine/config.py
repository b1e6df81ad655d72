"""The in-process engine's configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.serving_config import (
    BatchingConfig,
    ChatConfig,
    DebugConfig,
    DeviceConfig,
    KvTierConfig,
    LoraConfig,
    ModelConfig,
    RuntimeConfig,
    SpeculationConfig,
    WeightsConfig,
)
from services.scheduler.config import AllocationPolicy


@dataclass(frozen=True, slots=True)
class EngineConfig(
    ModelConfig,
    ChatConfig,
    WeightsConfig,
    BatchingConfig,
    RuntimeConfig,
    SpeculationConfig,
    LoraConfig,
    DeviceConfig,
    KvTierConfig,
    DebugConfig,
):
    """The worker's and the scheduler's shared groups (services.common.serving_config), plus
    what only the in-process engine has. quantization is ignored when a loaded model is
    given."""

    allocation_policy: AllocationPolicy = "paged"
    """"max_length" reserves each request's worst case up front (for comparison only)."""
    threads: int | None = None
    """torch CPU threads; unset = one per core (the worker's flag)."""

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
        self.check_lora()
        self.check_kv_tiers(self.device)
