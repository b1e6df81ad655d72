"""Pinned prefixes: a finished request's cached prompt blocks held out of eviction by name.

A pin is one more reference per block, so the block pool's LRU never takes them; unpinning
drops the references and the blocks become evictable again (still findable in the cache).
Named system prompts are pinned this way on every scheduler that serves their tenant.
"""

from __future__ import annotations

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


class PinnedPrefixes:
    def __init__(self, kv: KVCacheManager, max_pinned_fraction: float) -> None:
        self.kv = kv
        self.max_pinned_blocks = int(max_pinned_fraction * kv.num_total_blocks)
        self._pins: dict[str, list[int]] = {}

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def pinned_tokens(self, name: str) -> int:
        return len(self._pins.get(name, ())) * self.kv.block_size

    def tables(self) -> list[list[int]]:
        """Every pin's blocks: references the KV manager's integrity check counts too."""
        return list(self._pins.values())

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
