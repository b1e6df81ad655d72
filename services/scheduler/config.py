"""Scheduler configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AllocationPolicy = Literal["paged", "max_length"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler batches requests and manages KV memory."""

    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 128
    """Most sequences in one step (running + newly admitted)."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step, shared by prefill chunks and decodes."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) the model accepts."""
    watermark: float = 0.01
    """Fraction of blocks kept free when admitting, so running decodes can still grow."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose chained token hash is already cached."""
    allocation_policy: AllocationPolicy = "paged"
    """"paged": blocks on demand; "max_length": a contiguous worst-case run per request."""
    max_waiting_requests: int = 1024
    """Bound of the waiting queue; add_request beyond it raises QueueFullError."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request may compute in one step (0 = no cap but the budget)."""
    max_pinned_fraction: float = 0.5
    """Most of the KV blocks that pinned prefixes (named system prompts) may hold."""

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
