"""Per-request block tables on top of the block pool: prefix hits, growth, copy-on-write, caching.

Two allocation policies share this interface:
  "paged"      blocks are taken as tokens arrive; full computed blocks join the prefix cache.
  "max_length" a request reserves one contiguous run for its worst-case length up front and
               never grows (the pre-PagedAttention baseline; no prefix caching).

In a model whose every layer has a sliding window, "paged" also gives back the blocks a running
request's future queries can no longer see (services/scheduler/features/sliding_window.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.scheduler.block_pool import BlockHash, BlockPool, hash_block_tokens
from services.scheduler.config import AllocationPolicy, SchedulerConfig
from services.scheduler.features.kv_disk import DiskTierView
from services.scheduler.features.sliding_window import RELEASED_BLOCK, num_dead_blocks
from services.scheduler.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        allocation_policy: AllocationPolicy = "paged",
        max_model_len: int = 2048,
        watermark: float = 0.0,
        sliding_window: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.is_paged = allocation_policy == "paged"
        self.enable_prefix_caching = enable_prefix_caching and self.is_paged
        self.pool = BlockPool(num_blocks, enable_caching=self.enable_prefix_caching)
        # A max-length reservation already covers growth, so it needs no headroom.
        self.watermark_blocks = int(watermark * num_blocks) if self.is_paged else 0
        # The window every layer of the model attends through (0: some layer sees the whole
        # context). A max-length reservation is all-or-nothing, so it keeps its blocks.
        self.sliding_window = sliding_window if self.is_paged else 0
        self._block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_forked_block_refs = 0
        """Block references forks gave away instead of allocating (running total)."""
        self.num_block_copies = 0
        """Shared blocks copied on a write (running total)."""
        self.disk: DiskTierView | None = None
        """The worker's KV disk tier, told of each block cached (None: the worker has none)."""

    @classmethod
    def from_config(
        cls, config: SchedulerConfig, num_blocks: int, sliding_window: int = 0
    ) -> KVCacheManager:
        """The scheduler's: `num_blocks` and `sliding_window` are its worker's."""
        return cls(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            allocation_policy=config.allocation_policy,
            max_model_len=config.max_model_len,
            watermark=config.watermark,
            sliding_window=sliding_window,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reservation_tokens(self, request: Request) -> int:
        """Worst-case length of a request: what "max_length" reserves at admission."""
        return min(request.num_prompt_tokens + request.sampling.max_new_tokens, self.max_model_len)

    def can_ever_fit(self, request: Request) -> bool:
        """False when the request could not be admitted even into an empty pool.

        Worst case, window or not: a sequence longer than the whole pool is refused even when
        a sliding window would let it run in chunks holding only its window."""
        if self.is_paged:
            return self.num_blocks_for(request.num_tokens + 1) <= self.num_total_blocks
        return self.num_blocks_for(self.reservation_tokens(request)) <= self.num_total_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        return self._block_tables[request_id]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached full-block prefix of a request not yet admitted: (blocks, tokens).

        Capped one token short of the request's end: the step that computes the last token is
        the one that samples, so at least one token must always be computed.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        blocks: list[int] = []
        for index in range((request.num_tokens - 1) // self.block_size):
            block_id = self.pool.get_cached_block(self._block_hash(request, index))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def uncached_block_hashes(
        self, request: Request, num_cached_blocks: int
    ) -> Iterator[BlockHash]:
        """Hashes of the full blocks after the first `num_cached_blocks`, up to the same cap as
        get_computed_blocks (where a lower tier may hold what the pool does not)."""
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return
        for index in range(num_cached_blocks, (request.num_tokens - 1) // self.block_size):
            yield self._block_hash(request, index)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        *,
        reserve_watermark: bool = True,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of KV. Returns the blocks appended to the
        request's table (all of them, for a new request), or None when they do not fit.

        Admitting a new request keeps the watermark free unless `reserve_watermark` is False
        (the scheduler drops it when nothing is running: no decode needs the headroom).
        """
        table = self._block_tables.get(request.request_id)
        if table is None:
            if not self.is_paged:
                return self._reserve_max_length(request)
            headroom = self.watermark_blocks if reserve_watermark else 0
            return self._admit(request, num_new_tokens, computed_blocks or [], headroom)
        if not self.is_paged:
            return []
        self._release_out_of_window(request, table)
        return self._grow(request, table, num_new_tokens)

    def _admit(
        self, request: Request, num_new_tokens: int, computed: list[int], headroom: int
    ) -> list[int] | None:
        num_computed = len(computed) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(computed)
        # A hit on a freed cached block takes it out of the free queue, so it costs capacity.
        num_revived = sum(1 for block_id in computed if self.pool.ref_count(block_id) == 0)
        if num_needed + num_revived > self.num_free_blocks - headroom:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.allocate(num_needed)
        self._block_tables[request.request_id] = computed + new_blocks
        self._num_cached_blocks[request.request_id] = len(computed)
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += num_computed
        return new_blocks

    def _reserve_max_length(self, request: Request) -> list[int] | None:
        num_blocks = self.num_blocks_for(self.reservation_tokens(request))
        blocks = self.pool.allocate_contiguous(num_blocks)
        if blocks is None:
            return None
        self._block_tables[request.request_id] = blocks
        self._num_cached_blocks[request.request_id] = 0
        return list(blocks)

    def _grow(self, request: Request, table: list[int], num_new_tokens: int) -> list[int] | None:
        num_blocks_after = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        num_needed = max(0, num_blocks_after - len(table))
        shared = self._shared_blocks_to_write(request, table, num_blocks_after)
        if num_needed + len(shared) > self.num_free_blocks:
            return None
        for index in shared:
            self._copy_on_write(table, index)
        if num_needed == 0:
            return []  # the common decode step: the token fits the last block
        new_blocks = self.pool.allocate(num_needed)
        table.extend(new_blocks)
        return new_blocks

    def _release_out_of_window(self, request: Request, table: list[int]) -> None:
        """Give back the blocks before the window of every query `request` will make (called
        before its next tokens are placed, so `num_computed_tokens` is where they start).

        Their entries become RELEASED_BLOCK, always a prefix of the table, so nothing frees
        them twice; a block a fork or a prefix hit shares, or a cached one, follows the pool's
        reference counts as on any free. The worker's copy of the table keeps the old ids at
        those indices (a sequence sent whole later, a fork, gets RELEASED_BLOCK there), and no
        kernel reads them: attention starts at the block holding the window's first key
        (kernels/attention_torch.py). A freed block handed to another
        sequence is written only by a plan made after this one, and the worker runs plans in
        order, so a plan still in flight that reads it has run by then.
        """
        num_dead = min(
            num_dead_blocks(request.num_computed_tokens, self.sliding_window, self.block_size),
            len(table),
        )
        if num_dead == 0 or table[num_dead - 1] == RELEASED_BLOCK:
            return  # nothing new fell out of the window: the decode step's common case
        # Publish first: a block freed before it is cached could never be a prefix hit.
        self._cache_blocks(request, num_dead)
        first = num_dead - 1
        while first > 0 and table[first - 1] != RELEASED_BLOCK:
            first -= 1
        self.pool.free(reversed(table[first:num_dead]))
        table[first:num_dead] = [RELEASED_BLOCK] * (num_dead - first)

    def reserve_lookahead(self, request: Request, num_tokens_ahead: int) -> list[int] | None:
        """Room for KV up to `num_tokens_ahead` tokens past the computed ones (draft tokens a
        step may write), never by preempting: None when the free blocks do not hold it.
        Returns the blocks appended (a max-length reservation already holds them: [])."""
        table = self._block_tables[request.request_id]
        if not self.is_paged:
            return []
        return self._grow(request, table, num_tokens_ahead)

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Free the blocks past those `num_tokens` tokens need (a draft reservation no longer
        wanted). Returns the table's new length, or None when nothing was freed. Only blocks
        past every computed token qualify, so none of them is cached, shared or released."""
        table = self._block_tables.get(request.request_id)
        if table is None or not self.is_paged:
            return None
        num_kept = max(self.num_blocks_for(num_tokens), self._num_cached_blocks[request.request_id])
        if len(table) <= num_kept:
            return None
        self.pool.free(reversed(table[num_kept:]))
        del table[num_kept:]
        return num_kept

    def _shared_blocks_to_write(
        self, request: Request, table: list[int], num_blocks_after: int
    ) -> list[int]:
        """Indices of blocks this step writes into that another sequence also references."""
        first = request.num_computed_tokens // self.block_size
        if first >= len(table):
            return []  # writes only into blocks about to be allocated
        ref_count = self.pool.ref_count
        last = min(num_blocks_after, len(table))
        return [i for i in range(first, last) if ref_count(table[i]) > 1]

    def _copy_on_write(self, table: list[int], index: int) -> None:
        source = table[index]
        (copy,) = self.pool.allocate(1)
        self._pending_copies.append((source, copy))
        self.num_block_copies += 1
        self.pool.free([source])
        table[index] = copy

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the worker must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are now full and computed (call after update)."""
        self._cache_blocks(request, request.num_computed_tokens // self.block_size)

    def _cache_blocks(self, request: Request, num_full: int) -> None:
        """Publish the request's first `num_full` blocks (all full and computed)."""
        if not self.enable_prefix_caching:
            return
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return  # most steps: no block became full
        table = self._block_tables[request.request_id]
        for index in range(num_cached, num_full):
            block_hash = self._block_hash(request, index)
            if self.pool.cache_block(table[index], block_hash) and self.disk is not None:
                self.disk.block_cached(table[index], block_hash, request)
        self._num_cached_blocks[request.request_id] = num_full

    def _block_hash(self, request: Request, index: int) -> BlockHash:
        """Hash of full block `index`, memoized per request (the chain needs all parents)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        while len(hashes) <= index:
            start = len(hashes) * self.block_size
            tokens = request.token_ids_slice(start, start + self.block_size)
            salt = request.cache_salt if not hashes else b""
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, salt))
        return hashes[index]

    def cached_prompt_blocks(self, request: Request) -> list[int]:
        """The cached blocks of `request`'s full prompt blocks, from the first, up to the
        first one not cached (none when caching is off). A sliding window's released prompt
        blocks are found while still cached."""
        blocks: list[int] = []
        for index in range(request.num_prompt_tokens // self.block_size):
            block_id = self.pool.get_cached_block(self._block_hash(request, index))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int | None = None) -> None:
        """Give `child_id` the parent's blocks, shared (refcount + 1); the first write into a
        shared block copies it. The caller gives the child the parent's tokens.

        With `num_computed_tokens`, the partial block the child writes next is copied now
        (one free block needed: `num_blocks_to_fork`). The parent may already be on the
        worker, whose block tables only grow: so the parent keeps the original, and each
        child, not sent yet, gets the copy in its first table.
        """
        table = self._block_tables[parent_id]
        held = _held(table)
        self.pool.touch(held)
        child_table = list(table)
        self._block_tables[child_id] = child_table
        self._num_cached_blocks[child_id] = self._num_cached_blocks[parent_id]
        self._block_hashes[child_id] = list(self._block_hashes.get(parent_id, []))
        num_copied = 0
        if (
            num_computed_tokens is not None
            and self._partial_block_index(table, num_computed_tokens) is not None
        ):
            self._copy_on_write(child_table, num_computed_tokens // self.block_size)
            num_copied = 1
        self.num_forked_block_refs += len(held) - num_copied

    def num_blocks_to_fork(self, request: Request) -> int:
        """Free blocks one `fork(..., request.num_computed_tokens)` of `request` takes."""
        table = self._block_tables[request.request_id]
        return int(self._partial_block_index(table, request.num_computed_tokens) is not None)

    def _partial_block_index(self, table: list[int], num_computed_tokens: int) -> int | None:
        """The index of the block that holds token `num_computed_tokens` when it is already in
        `table` with earlier tokens in it (None: the token starts a block not allocated yet)."""
        index = num_computed_tokens // self.block_size
        if num_computed_tokens % self.block_size and index < len(table):
            return index
        return None

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op if it holds none). Cached ones stay findable."""
        table = self._block_tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        if table:
            # Tail first: a sequence's last blocks are the least likely to be someone's prefix.
            self.pool.free(reversed(_held(table)))

    def check_integrity(self, other_references: Iterable[list[int]] = ()) -> None:
        """The pool is consistent, its refcounts are exactly the block-table references plus
        `other_references` (pins), and released entries only lead a table."""
        self.pool.check_integrity()
        counts = [0] * self.num_total_blocks
        for table in self._block_tables.values():
            num_released = table.count(RELEASED_BLOCK)
            assert table[:num_released] == [RELEASED_BLOCK] * num_released, table
        for table in [*self._block_tables.values(), *other_references]:
            for block_id in _held(table):
                counts[block_id] += 1
        for block_id, count in enumerate(counts):
            assert count == self.pool.ref_count(block_id), (
                f"block {block_id}: {count} table references, refcount "
                f"{self.pool.ref_count(block_id)}"
            )


def _held(table: list[int]) -> list[int]:
    """The blocks a table still references (its released entries left out)."""
    return [block_id for block_id in table if block_id != RELEASED_BLOCK]
