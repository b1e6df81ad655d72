"""Pinned prefixes: a finished request's cached prompt blocks held out of eviction by name.

A pin is one more reference per block, so the block pool's LRU never takes them; unpinning
drops the references and the blocks become evictable again (still findable in the cache).
Named system prompts are pinned this way on every scheduler that serves their tenant: a
pinning request is queued with the name to pin its prompt under (`pin_on_finish`), and the
core hands every request leaving the scheduler to `on_released`, before its blocks are freed.
"""

from __future__ import annotations

from services.contracts.step import FinishReason
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request

_COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


class PinnedPrefixes:
    def __init__(self, kv: KVCacheManager, max_pinned_fraction: float) -> None:
        self.kv = kv
        self.max_pinned_blocks = int(max_pinned_fraction * kv.num_total_blocks)
        self._pins: dict[str, list[int]] = {}
        self._on_finish: dict[str, str] = {}
        """Pinning requests held (request id -> the name to pin their prompt under)."""

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def pinned_tokens(self, name: str) -> int:
        return len(self._pins.get(name, ())) * self.kv.block_size

    def tables(self) -> list[list[int]]:
        """Every pin's blocks: references the KV manager's integrity check counts too."""
        return list(self._pins.values())

    def pin_on_finish(self, request_id: str, name: str) -> None:
        """When the request completes (stop or length, not an abort or a deadline), its
        prompt's full blocks stay pinned under `name` instead of becoming evictable."""
        self._on_finish[request_id] = name

    def on_released(self, request: Request) -> None:
        """`request` leaves the scheduler; its blocks are not freed yet."""
        name = self._on_finish.pop(request.request_id, None)
        if name is not None and request.finish_reason in _COMPLETED:
            self.pin(name, request)

    def request_ids(self) -> set[str]:
        """The pinning requests it keeps state for (the core's integrity check)."""
        return set(self._on_finish)

    def pin(self, name: str, request: Request) -> int:
        """Hold the cached full blocks of `request`'s prompt under `name` (replacing an older
        pin of that name). Returns the tokens pinned: 0 when caching is off or the pin would
        take more than the pinned-block budget. Prompt blocks a sliding window released are
        found while still cached; the pin stops at the first one evicted.

        Called before the request's own blocks are freed, so they never pass through the
        free queue in between."""
        self.unpin(name)
        if not self.kv.enable_prefix_caching:
            return 0
        blocks = self.kv.cached_prompt_blocks(request)
        if self.num_pinned_blocks + len(blocks) > self.max_pinned_blocks:
            return 0
        self.kv.pool.touch(blocks)
        self._pins[name] = blocks
        return len(blocks) * self.kv.block_size

    def unpin(self, name: str) -> bool:
        """Let a pinned prefix's blocks be evicted again; False if nothing is pinned so."""
        blocks = self._pins.pop(name, None)
        if blocks is None:
            return False
        self.kv.pool.free(reversed(blocks))
        return True
