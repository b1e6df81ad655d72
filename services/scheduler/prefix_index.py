"""Mirrors this scheduler's prefix cache into Redis, off the step loop.

The block pool calls `block_cached` / `block_evicted` inside the step loop; they only record
the hash in a dict (latest state wins). A background task writes the net changes every
`flush_s` in one pipeline: SET key epoch EX ttl for cached blocks, DEL for evicted ones.

Redis is a hint, the block pool the truth. When a write fails (Redis down or slow), pending
changes are dropped and a full resync (every cached hash, from the pool) follows once Redis
answers again; evictions missed meanwhile linger until their TTL, and cost at most a routing
miss. A periodic full refresh re-arms TTLs and repairs a flushed Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.common.cache_keys import CacheKeys
from services.common.prefix_hash import BlockHash
from services.common.redis_store import RedisStore

log = logging.getLogger(__name__)

_BATCH = 2000  # commands per pipeline round trip


class PrefixIndexPublisher:
    def __init__(
        self,
        store: RedisStore,
        scheduler_id: str,
        *,
        ttl_s: float = 600.0,
        refresh_s: float = 120.0,
        flush_s: float = 0.05,
        max_pending: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.keys: CacheKeys | None = None
        self.scheduler_id = scheduler_id
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.flush_s = flush_s
        self.max_pending = max_pending
        self._clock = clock
        self._epoch: str | None = None
        self._snapshot: Callable[[], list[BlockHash]] | None = None
        self._pending: dict[BlockHash, bool] = {}  # True = cached, False = evicted
        self._needs_resync = False
        self._next_refresh = 0.0
        self._seen_recoveries = store.num_recoveries

    # ---- the block pool's listener (step loop: record only) -----------------------------

    def block_cached(self, block_hash: BlockHash) -> None:
        self._record(block_hash, True)

    def block_evicted(self, block_hash: BlockHash) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: BlockHash, cached: bool) -> None:
        if self._epoch is None:
            return
        self._pending[block_hash] = cached
        if len(self._pending) > self.max_pending:
            # Redis cannot keep up: forget the diff, resync from the pool later.
            log.warning("prefix index backlog dropped", extra={"entries": len(self._pending)})
            self._pending.clear()
            self._needs_resync = True

    # ---- lifecycle ------------------------------------------------------------------------

    def attach(self, epoch: str, keys: CacheKeys, snapshot: Callable[[], list[BlockHash]]) -> None:
        """A worker (with an empty KV cache) connected: entries now carry `epoch`; entries of
        older epochs are stale and readers ignore them. `keys` scope them to its model."""
        self._epoch = epoch
        self.keys = keys
        self._snapshot = snapshot
        self._pending.clear()
        self._needs_resync = True

    def detach(self) -> None:
        """The worker is gone: its cache is gone with it, stop publishing."""
        self._epoch = None
        self._snapshot = None
        self._pending.clear()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Write the pending changes, or everything when a resync or refresh is due."""
        epoch, snapshot, keys = self._epoch, self._snapshot, self.keys
        if epoch is None or snapshot is None or keys is None:
            return
        if self.store.num_recoveries != self._seen_recoveries:
            self._seen_recoveries = self.store.num_recoveries
            self._needs_resync = True
        full = self._needs_resync or self._clock() >= self._next_refresh
        if full:
            changes: Iterable[tuple[BlockHash, bool]] = [(h, True) for h in snapshot()]
            self._pending.clear()
        elif self._pending:
            changes, self._pending = list(self._pending.items()), {}
        else:
            return
        if not await self._write(keys, epoch, list(changes)):
            self._needs_resync = True
            return
        if full:
            self._needs_resync = False
            self._next_refresh = self._clock() + self.refresh_s

    async def _write(
        self, keys: CacheKeys, epoch: str, changes: list[tuple[BlockHash, bool]]
    ) -> bool:
        """False when Redis did not take every batch."""
        ttl_ms = int(self.ttl_s * 1000)
        for start in range(0, max(len(changes), 1), _BATCH):
            batch = changes[start : start + _BATCH]

            async def write_batch(client: Any, batch: list[tuple[BlockHash, bool]] = batch) -> Any:
                pipe = client.pipeline(transaction=False)
                for block_hash, cached in batch:
                    key = keys.block(self.scheduler_id, block_hash)
                    if cached:
                        pipe.set(key, epoch, px=ttl_ms)
                    else:
                        pipe.delete(key)
                return await pipe.execute()

            if await self.store.call("prefix index write", write_batch) is None:
                return False
        return True
