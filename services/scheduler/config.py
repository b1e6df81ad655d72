"""Scheduler configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.serving_config import (
    BatchingConfig,
    DebugConfig,
    SpeculationConfig,
    WeightsConfig,
)

AllocationPolicy = Literal["paged", "max_length"]


@dataclass(frozen=True)
class AdmissionConfig:
    """How much KV memory admission keeps back; shared by the core and the server."""

    watermark: float = 0.01
    """Fraction of KV blocks kept free when admitting, so running decodes can still grow."""
    max_pinned_fraction: float = 0.5
    """Most of the KV blocks that pinned prefixes (named system prompts) may hold."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig(BatchingConfig, AdmissionConfig, SpeculationConfig, DebugConfig):
    """How the scheduler batches requests and manages KV memory."""

    block_size: int = WeightsConfig.block_size
    """Tokens per KV block (the worker's)."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) the model accepts, resolved: the server passes the
    worker's, so this default serves tests and benchmarks only."""
    allocation_policy: AllocationPolicy = "paged"
    """"paged": blocks on demand; "max_length": a contiguous worst-case run per request."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request may compute in one step (0 = no cap but the budget)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        if self.allocation_policy not in ("paged", "max_length"):
            raise ValueError(f"unknown allocation_policy {self.allocation_policy!r}")
        self.check_speculation()
