"""A snapshot of the scheduler's queues, KV blocks and running totals (metrics, GetStats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_pinned_blocks: int = 0
    num_forked_block_refs: int = 0
    """Block references forked choices took from their request's prompt (running total)."""
    num_block_copies: int = 0
    """Shared blocks copied on a choice's first write into them (running total)."""
    num_draft_tokens_proposed: int = 0
    """Draft tokens the worker verified (speculative decoding; running total)."""
    num_draft_tokens_accepted: int = 0
    """Of those, the ones the model agreed with, each an output token for free."""
    num_speculative_steps: int = 0
    """Sequence-steps that verified drafts (tokens per such step: 1 + accepted / steps)."""
    active_lora_adapters: frozenset[str] = frozenset()
    """LoRA adapters the running requests use (in the worker's slots)."""

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queried_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens
