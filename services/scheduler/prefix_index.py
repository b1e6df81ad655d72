"""Mirrors this scheduler's prefix cache into Redis, off the step loop.

The block pool calls `block_cached` / `block_evicted` inside the step loop, and the worker's
disk tier view `disk_added` / `disk_evicted`; they only note the hash (latest state wins). A
background task writes the net changes every `flush_s` in one pipeline: SET key epoch EX ttl for
a block in the KV pool, SET key "epoch:disk" for one only on disk (cache_keys.py), DEL for one
in neither. A block evicted from the pool but kept on disk stays in the index, so routing still
sends its prefix where loading it back beats recomputing it (also after a worker restart: the
disk outlives the pool).

Redis is a hint, the block pool the truth. When a write fails (Redis down or slow), pending
changes are dropped and a full resync (every cached hash, from the pool) follows once Redis
answers again; evictions missed meanwhile linger until their TTL, and cost at most a routing
miss. A periodic full refresh re-arms TTLs and repairs a flushed Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.common.cache_keys import CacheKeys, block_entry
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
        self._disk_snapshot: Callable[[], Sequence[BlockHash]] | None = None
        # Hashes whose entry changed since the last write (ordered: a set would not be), and
        # where each block is now: what is written follows from the two sets.
        self._pending: dict[BlockHash, None] = {}
        self._in_pool: set[BlockHash] = set()
        self._on_disk: set[BlockHash] = set()
        self._needs_resync = False
        self._next_refresh = 0.0
        self._seen_recoveries = store.num_recoveries

    # ---- the block pool's listener (step loop: record only) -----------------------------

    def block_cached(self, block_hash: BlockHash) -> None:
        self._record(block_hash, self._in_pool.add)

    def block_evicted(self, block_hash: BlockHash) -> None:
        self._record(block_hash, self._in_pool.discard)

    # ---- the disk tier view's listener (step loop: record only) -------------------------

    def disk_added(self, block_hash: BlockHash) -> None:
        self._record(block_hash, self._on_disk.add)

    def disk_evicted(self, block_hash: BlockHash) -> None:
        self._record(block_hash, self._on_disk.discard)

    def _record(self, block_hash: BlockHash, move: Callable[[BlockHash], None]) -> None:
        if self._epoch is None:
            return
        move(block_hash)
        self._pending[block_hash] = None
        if len(self._pending) > self.max_pending:
            # Redis cannot keep up: forget the diff, resync from the pool later.
            log.warning("prefix index backlog dropped", extra={"entries": len(self._pending)})
            self._pending.clear()
            self._needs_resync = True

    # ---- lifecycle ------------------------------------------------------------------------

    def attach(
        self,
        epoch: str,
        keys: CacheKeys,
        snapshot: Callable[[], list[BlockHash]],
        disk_snapshot: Callable[[], Sequence[BlockHash]] | None = None,
    ) -> None:
        """A worker (with an empty KV cache) connected: entries now carry `epoch`; entries of
        older epochs are stale and readers ignore them. `keys` scope them to its model.
        `snapshot` lists the pool's cached hashes; `disk_snapshot` its disk tier's (None: it
        has no disk tier)."""
        self._epoch = epoch
        self.keys = keys
        self._snapshot = snapshot
        self._disk_snapshot = disk_snapshot
        self._pending.clear()
        self._needs_resync = True

    def detach(self) -> None:
        """The worker is gone: its cache is gone with it, stop publishing."""
        self._epoch = None
        self._snapshot = None
        self._disk_snapshot = None
        self._pending.clear()
        self._in_pool.clear()
        self._on_disk.clear()

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
            # The truth, from the pool and the disk view: the sets noted from events may have
            # missed changes while a backlog was dropped.
            self._in_pool = set(snapshot())
            disk = self._disk_snapshot
            self._on_disk = set(disk()) if disk is not None else set()
            changes = [*self._in_pool, *self._on_disk.difference(self._in_pool)]
            self._pending.clear()
        elif self._pending:
            changes, self._pending = list(self._pending), {}
        else:
            return
        if not await self._write(keys, epoch, changes):
            self._needs_resync = True
            return
        if full:
            self._needs_resync = False
            self._next_refresh = self._clock() + self.refresh_s

    async def _write(self, keys: CacheKeys, epoch: str, changes: list[BlockHash]) -> bool:
        """False when Redis did not take every batch."""
        ttl_ms = int(self.ttl_s * 1000)
        for start in range(0, max(len(changes), 1), _BATCH):
            batch = changes[start : start + _BATCH]

            async def write_batch(client: Any, batch: list[BlockHash] = batch) -> Any:
                pipe = client.pipeline(transaction=False)
                for block_hash in batch:
                    key = keys.block(self.scheduler_id, block_hash)
                    in_pool = block_hash in self._in_pool
                    if in_pool or block_hash in self._on_disk:
                        pipe.set(key, block_entry(epoch, on_disk=not in_pool), px=ttl_ms)
                    else:
                        pipe.delete(key)
                return await pipe.execute()

            if await self.store.call("prefix index write", write_batch) is None:
                return False
        return True
