"""A fixed pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache hash map.

Freed blocks that hold a cached hash stay findable by that hash until they are reallocated,
so a later request with the same prefix takes them back instead of recomputing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from services.common.prefix_hash import BlockHash, hash_block_tokens

__all__ = ["BlockHash", "BlockPool", "CacheListener", "hash_block_tokens"]


class CacheListener(Protocol):
    """Told when a hash enters or leaves the prefix cache (e.g. to mirror it into Redis).
    Called inside the step loop: implementations must only record, never do I/O."""

    def block_cached(self, block_hash: BlockHash) -> None: ...

    def block_evicted(self, block_hash: BlockHash) -> None: ...


class BlockPool:
    """Owns every block id in [0, num_blocks). Callers hold blocks by reference count."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Head = next to allocate (least recently freed); tail = most recently freed.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.listener: CacheListener | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached ones included: they are evictable)."""
        return len(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_queue

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (a snapshot, for a full resync of a mirror)."""
        return list(self._cached)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free_queue)} free")
        block_ids = [self._free_queue.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
        return block_ids

    def allocate_contiguous(self, num_blocks: int) -> list[int] | None:
        """First-fit run of `num_blocks` consecutive free ids, or None (external fragmentation).

        Used only by the "max_length" policy, which exists to be compared against paging.
        """
        run_start, run_length = 0, 0
        for block_id in range(self.num_blocks):
            if self._ref_counts[block_id] != 0:
                run_length = 0
                continue
            if run_length == 0:
                run_start = block_id
            run_length += 1
            if run_length == num_blocks:
                block_ids = list(range(run_start, run_start + num_blocks))
                for taken in block_ids:
                    del self._free_queue[taken]
                    self._evict_hash(taken)
                    self._ref_counts[taken] = 1
                return block_ids
        return None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix hit or a fork); revives freed cached blocks."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free-queue tail.

        Callers pass a sequence's blocks tail-first so its last blocks, the least likely to be
        shared as someone's prefix, are evicted first.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full, computed block under its hash. False when caching is off, or when an
        equal block is already cached (two requests computed the same prefix at once)."""
        if not self.enable_caching or block_hash in self._cached:
            return False
        if self._block_hashes[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached")
        self._block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.listener is not None:
            self.listener.block_cached(block_hash)
        return True

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hashes[block_id] = None
            if self.listener is not None:
                self.listener.block_evicted(block_hash)

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        num_held = sum(1 for count in self._ref_counts if count > 0)
        assert num_held + len(self._free_queue) == self.num_blocks, "free + held != total"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has refcount {count}"
            assert (count == 0) == (block_id in self._free_queue), (
                f"block {block_id}: refcount {count} but free={block_id in self._free_queue}"
            )
        for block_hash, block_id in self._cached.items():
            assert self._block_hashes[block_id] == block_hash, f"hash map wrong for {block_id}"
        num_hashed = sum(1 for h in self._block_hashes if h is not None)
        assert num_hashed == len(self._cached), "a block holds a hash missing from the map"
