"""A snapshot of the scheduler's queues, KV blocks and running totals (metrics, GetStats)."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.features.draft_slots import DraftSlots
from services.scheduler.features.lora_admission import LoraAdmission
from services.scheduler.features.pins import PinnedPrefixes
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


class StatsSource(Protocol):
    """What the stats read of a scheduler: its queues, KV manager and the features that count
    (a protocol, so that this module need not import the scheduler that imports it)."""

    @property
    def waiting(self) -> Sized: ...
    @property
    def running(self) -> Sequence[Request]: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def kv(self) -> KVCacheManager: ...
    @property
    def pins(self) -> PinnedPrefixes: ...
    @property
    def drafts(self) -> DraftSlots: ...
    @property
    def loras(self) -> LoraAdmission: ...


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
    num_draft_tokens_granted: int = 0
    """Draft slots the scheduler granted (speculative decoding; running total)."""
    num_draft_tokens_proposed: int = 0
    """Draft tokens the worker verified (running total)."""
    num_draft_tokens_accepted: int = 0
    """Of those, the ones the model agreed with, each an output token for free."""
    num_speculative_steps: int = 0
    """Sequence-steps that verified drafts (tokens per such step: 1 + accepted / steps)."""
    active_lora_adapters: frozenset[str] = frozenset()
    """LoRA adapters the running requests use (in the worker's slots)."""

    @classmethod
    def of(cls, scheduler: StatsSource) -> SchedulerStats:
        kv, drafts = scheduler.kv, scheduler.drafts
        return cls(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            prefix_queried_tokens=kv.prefix_queried_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_pinned_blocks=scheduler.pins.num_pinned_blocks,
            num_forked_block_refs=kv.num_forked_block_refs,
            num_block_copies=kv.num_block_copies,
            num_draft_tokens_granted=drafts.num_draft_tokens_granted,
            num_draft_tokens_proposed=drafts.num_draft_tokens_proposed,
            num_draft_tokens_accepted=drafts.num_draft_tokens_accepted,
            num_speculative_steps=drafts.num_speculative_steps,
            active_lora_adapters=scheduler.loras.in_use(scheduler.running),
        )

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queried_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens
