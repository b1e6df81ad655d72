"""The worker's KV disk tier as the scheduler sees it: which chain hashes the disk holds
(from Describe, then each step result's changes), and the blocks cached since the last plan
that the worker should write down (docs/prefix-cache.md, Disk tier)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from services.contracts.step import DiskStore, StepResult


class CachedRequest(Protocol):
    @property
    def lora_name(self) -> str: ...

    @property
    def cache_salt(self) -> bytes: ...


class DiskListener(Protocol):
    """Hears what the disk gains and loses (the Redis prefix index: prefix_index.py)."""

    def disk_added(self, block_hash: bytes) -> None: ...

    def disk_evicted(self, block_hash: bytes) -> None: ...


class DiskTierView:
    def __init__(self, hashes: list[bytes]) -> None:
        self._on_disk: dict[bytes, None] = dict.fromkeys(hashes)
        self._stores: list[DiskStore] = []
        self.listener: DiskListener | None = None

    def hashes(self) -> list[bytes]:
        return list(self._on_disk)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._on_disk

    def block_cached(self, block_id: int, block_hash: bytes, request: CachedRequest) -> None:
        """A block just joined the prefix cache: the next plan asks the worker to write it,
        unless the disk has it already."""
        if block_hash not in self._on_disk:
            self._stores.append(
                DiskStore(block_id, block_hash, request.lora_name, request.cache_salt)
            )

    def hits(self, block_hashes: Iterable[bytes]) -> list[bytes]:
        """The leading hashes of `block_hashes` the disk holds (those after the pool's hits)."""
        found: list[bytes] = []
        for block_hash in block_hashes:
            if block_hash not in self._on_disk:
                break
            found.append(block_hash)
        return found

    @property
    def has_stores(self) -> bool:
        """Blocks wait to go down: a plan is owed to the worker even when nothing runs."""
        return bool(self._stores)

    def take_stores(self) -> list[DiskStore]:
        """The stores for the plan being made. Taken at once, so a plan that reallocates one of
        these blocks carries its store, which the worker reads before the plan's writes."""
        stores, self._stores = self._stores, []
        return stores

    def on_result(self, result: StepResult) -> None:
        listener = self.listener
        for block_hash in result.disk_added:
            self._on_disk[block_hash] = None
            if listener is not None:
                listener.disk_added(block_hash)
        for block_hash in result.disk_evicted:
            self._on_disk.pop(block_hash, None)
            if listener is not None:
                listener.disk_evicted(block_hash)
