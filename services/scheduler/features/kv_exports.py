"""Prefix exports in the scheduler core (docs/prefix-cache.md, Prefix fetch): another pair's
request fetches the KV of a prefix this pool holds, instead of computing it.

The blocks are found by the prefix's chain hashes, named in the next plan and copied out by the
worker before that plan's writes, as disk stores are. So an export holds no block reference and
takes no seat or token budget: a block the same plan reallocates is read with its old contents
first. A block the pool evicted but the worker's KV disk tier keeps is read from disk by its
hash; one in neither is not found (the caller computes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.prefix_hash import prefix_block_hashes
from services.contracts.errors import ConflictError, InvalidRequestError
from services.contracts.kv_transfer import ON_DISK, KvDestination, KvExport
from services.scheduler.block_pool import BlockPool
from services.scheduler.features.kv_disk import DiskTierView


class KvExports:
    def __init__(self, pool: BlockPool, block_size: int, disk: DiskTierView | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.disk = disk
        self._pending: list[KvExport] = []

    def add(self, request_id: str, token_ids: Sequence[int], destination: KvDestination) -> int:
        """Export the blocks of the prefix `token_ids` (whole blocks, hashed under the
        destination's salt) from destination.first_block on, one per destination block, with
        the next plan. Returns the number of blocks. InvalidRequestError for a malformed ask,
        ConflictError when the pool no longer holds every block asked for."""
        if not request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        if not token_ids or len(token_ids) % self.block_size:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"must be whole blocks of {self.block_size} tokens (got {len(token_ids)})",
            )
        hashes = prefix_block_hashes(token_ids, self.block_size, destination.cache_salt)
        end = destination.first_block + destination.num_blocks
        if not destination.block_ids or end > len(hashes):
            raise InvalidRequestError(
                "kv_destination.block_ids",
                f"names blocks {destination.first_block}..{end - 1} of a"
                f" {len(hashes)}-block prefix",
            )
        block_ids: list[int] = []
        for index in range(destination.first_block, end):
            block_id = self.pool.get_cached_block(hashes[index])
            if block_id is None and self.disk is not None and self.disk.holds(hashes[index]):
                block_id = ON_DISK
            if block_id is None:
                raise ConflictError(
                    f"block {index} of the prefix is no longer cached here; compute it instead"
                )
            block_ids.append(block_id)
        sent_hashes = list(hashes[destination.first_block : end])
        self._pending.append(KvExport(request_id, block_ids, destination, sent_hashes))
        return len(block_ids)

    @property
    def has_pending(self) -> bool:
        """Exports wait for a plan: one is owed to the worker even when nothing runs."""
        return bool(self._pending)

    def take(self) -> list[KvExport]:
        """The exports for the plan being made."""
        exports, self._pending = self._pending, []
        return exports
