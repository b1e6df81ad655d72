"""The KV disk tier's hook in the step: before a plan's forward, copy out the blocks the
scheduler just cached (written behind the step) and fill new sequences' prefix blocks from disk;
after it, report what the disk gained and lost. The files are kv_disk_tier.py's."""

from __future__ import annotations

from pathlib import Path

import torch

from services.contracts.step import FAILED_DISK_LOAD_PREFIX, BatchPlan, StepResult
from services.worker.config import GiB
from services.worker.kv_cache import PagedKVCache
from services.worker.kv_disk_lock import DirectoryLock
from services.worker.kv_disk_tier import (
    BlockScope,
    DiskIdentity,
    DiskWriter,
    KvDiskTier,
    model_fingerprint,
)
from services.worker.kv_transfer import CacheIdentity


def claim_directory(directory: Path) -> DirectoryLock | OSError:
    """Take the directory for this worker: first thing at start, so a second worker on it is
    refused (KvDiskInUseError) in a moment, not after loading a model. Any other error is
    returned, for the tier to turn itself off: serving goes on without it."""
    try:
        return DirectoryLock(directory)
    except OSError as exc:
        return exc


class KvDiskSteps:
    def __init__(
        self, tier: KvDiskTier, writer: DiskWriter, lock: DirectoryLock | None = None
    ) -> None:
        self.tier = tier
        self.writer = writer
        self.lock = lock

    @classmethod
    def open(
        cls,
        directory: Path,
        gib: float,
        model_path: Path,
        weights: str,
        identity: CacheIdentity,
        claim: DirectoryLock | OSError | None = None,
    ) -> KvDiskSteps:
        """Index `directory` for this model and cache. `weights` names how the weights run
        (quantization and compute dtype): the same file quantized otherwise computes other KV.
        `claim`: the directory claimed already (claim_directory), else claimed here."""
        if claim is None:
            claim = claim_directory(directory)
        fingerprint = f"{model_fingerprint(model_path)}:{weights}"
        tier = KvDiskTier(directory, int(gib * GiB), DiskIdentity(fingerprint, identity))
        if isinstance(claim, OSError):  # cannot even make the directory or its lock
            tier.disable("open", claim)
            return cls(tier, DiskWriter(tier))
        tier.open()
        return cls(tier, DiskWriter(tier), claim)

    def admit(self, plan: BatchPlan, kv_cache: PagedKVCache) -> tuple[BatchPlan, dict[str, str]]:
        """Store, then load (a block the plan reuses is stored with its old contents first).
        Returns the plan without the sequences whose blocks could not be loaded, and those."""
        # A tier that turned itself off (disk full, gone) costs the step no copy.
        if plan.disk_stores and self.tier.enabled:
            # The one copy on the step path: the rows are views of it, handed over as buffers;
            # the writer thread hashes and writes them (no bytes made here).
            rows = kv_cache.read_blocks([store.block_id for store in plan.disk_stores]).numpy()
            for store, row in zip(plan.disk_stores, rows, strict=True):
                scope = BlockScope(store.lora_name, store.cache_salt)
                self.writer.submit(store.block_hash, scope, memoryview(row))
        if not plan.disk_loads:
            return plan, {}
        failed: dict[str, str] = {}
        for seq in plan.new_sequences:
            loads = plan.disk_loads.get(seq.request_id)
            if not loads:
                continue
            scope = BlockScope(seq.lora_name, seq.cache_salt)
            payloads = [self.tier.get(block_hash, scope) for _, block_hash in loads]
            missing = [h.hex() for (_, h), p in zip(loads, payloads, strict=True) if p is None]
            if missing:
                failed[seq.request_id] = FAILED_DISK_LOAD_PREFIX + ", ".join(missing)
                continue
            # One copy of the payloads, into a writable buffer (frombuffer needs one).
            data = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8)  # type: ignore[arg-type]
            kv_cache.write_blocks([block_id for block_id, _ in loads], data)
        return (plan.without(set(failed)) if failed else plan), failed

    def report(self, result: StepResult) -> None:
        result.disk_added, result.disk_evicted = self.tier.take_changes()

    def close(self) -> None:
        """A graceful stop: write what is pending, then let another worker have the directory."""
        self.writer.close()
        if self.lock is not None:
            self.lock.release()
