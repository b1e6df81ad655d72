"""KV transfer between workers, the bytes side (docs/disaggregation.md): a prefill worker takes a
copy of a sequence's prompt blocks on the step that samples its first token (`KvOutbox`), and a
decode worker checks a transfer's header against its own cache before writing (`CacheIdentity`).
The gRPC calls are kv_transfer_service.py's.

    prefill sequence's block table:  [ b0 | b1 | b2 | b3 (partial) ]
    decode side cached b0, b1:                   └─────┴──▶ destination blocks, in order
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy
import torch

from services.contracts.kv_transfer import FAILED_TRANSFER_PREFIX, ON_DISK, KvDestination, KvExport
from services.contracts.step import BatchPlan, StepResult
from services.worker import kv_transfer_shm
from services.worker.input_batch import CachedSequence
from services.worker.kv_cache import PagedKVCache


class DiskBlocks(Protocol):
    """The worker's KV disk tier, as an export reads it (kv_disk_tier.py)."""

    def payload(self, block_hash: bytes, lora_name: str, cache_salt: bytes) -> bytes | None: ...


class KvTransferError(Exception):
    """A transfer that cannot be made or was refused; the message says why."""


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """What two workers must share for one's KV bytes to mean the same in the other's cache."""

    model_name: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_name: str, kv_cache: PagedKVCache) -> CacheIdentity:
        spec = kv_cache.spec
        return cls(
            model_name,
            str(spec.dtype).removeprefix("torch."),
            spec.block_size,
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
        )

    def mismatch(self, other: CacheIdentity) -> str | None:
        """The first field in which `other` differs, as a message; None when they agree."""
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: this worker has {mine!r}, the transfer {theirs!r}"
        return None

    def check_destination(self, destination: KvDestination) -> None:
        """Refuse to send where the decode side's scheduler reported another cache."""
        theirs = (destination.model_name, destination.kv_cache_dtype, destination.block_size)
        mine = (self.model_name, self.kv_cache_dtype, self.block_size)
        if theirs != mine:
            raise KvTransferError(
                f"kv_destination (model, KV dtype, block size) {theirs} does not match this"
                f" worker's {mine}"
            )


@dataclass(frozen=True, slots=True)
class OutgoingKv:
    """One sequence's prompt blocks, copied out of the cache, bound for a decode worker."""

    request_id: str
    destination: KvDestination
    lora_name: str
    cache_salt: bytes
    data: torch.Tensor
    """[destination.num_blocks, bytes per block] uint8, on the CPU (a mapped file for a
    shared-memory transfer)."""
    shm_name: str = ""
    """The shared-memory file `data` maps, in the sender's shm directory; empty = the bytes
    travel in the gRPC stream."""


class Transports:
    """Which way a destination's blocks go: through a shared-memory file when the decode
    worker reported this worker's own host identity (same boot, hostname and shm mount),
    else the gRPC byte stream. A destination that once refused a file is sent bytes from
    then on (its directory turned out not to be this one)."""

    def __init__(self, host_identity: str) -> None:
        self.host_identity = host_identity
        self._refused: set[str] = set()

    def shm_directory(self, destination: KvDestination) -> str:
        """The directory to write the destination's file in; empty = the byte stream."""
        if not self.host_identity or destination.host_identity != self.host_identity:
            return ""
        if destination.worker in self._refused:
            return ""
        return kv_transfer_shm.directory_of(self.host_identity)

    def refused(self, worker: str) -> None:
        self._refused.add(worker)


class KvOutbox:
    """Which sequences of the batch send their prompt's KV where; `collect` runs on the forward
    thread right after each step, so no later plan can have reused the blocks yet."""

    def __init__(self, identity: CacheIdentity, transports: Transports | None = None) -> None:
        self.identity = identity
        self.transports = transports or Transports("")
        self._destinations: dict[str, KvDestination] = {}

    def clear(self) -> None:
        self._destinations.clear()

    def collect(
        self,
        plan: BatchPlan,
        result: StepResult,
        sequences: dict[str, CachedSequence],
        kv_cache: PagedKVCache,
    ) -> list[OutgoingKv]:
        """The transfers due after this step: every sequence with a destination that sampled
        its first token. One that cannot be sent fails alone (result.failed_sequences)."""
        for request_id in plan.finished_request_ids:
            self._destinations.pop(request_id, None)
        for seq in plan.new_sequences:
            if seq.kv_destination is not None:
                self._destinations[seq.request_id] = seq.kv_destination
        if not self._destinations:
            return []
        outgoing: list[OutgoingKv] = []
        for request_id in list(result.sampled_token_ids):
            destination = self._destinations.pop(request_id, None)
            if destination is None:
                continue
            try:
                outgoing.append(self._copy_out(request_id, destination, sequences, kv_cache))
            except KvTransferError as exc:
                fail(result, request_id, str(exc))
        return outgoing

    def _copy_out(
        self,
        request_id: str,
        destination: KvDestination,
        sequences: dict[str, CachedSequence],
        kv_cache: PagedKVCache,
    ) -> OutgoingKv:
        self.identity.check_destination(destination)
        seq = sequences[request_id]
        salt, lora_name = seq.scope
        if (destination.lora_name, destination.cache_salt) != (lora_name, salt):
            raise KvTransferError(
                "kv_destination names another LoRA adapter or cache salt than the sequence's"
            )
        num_prompt_blocks = -(-seq.num_prompt_tokens // self.identity.block_size)
        source = seq.block_ids[destination.first_block : num_prompt_blocks]
        if len(source) != destination.num_blocks:
            raise KvTransferError(
                f"kv_destination has {destination.num_blocks} blocks for prompt blocks"
                f" {destination.first_block}..{num_prompt_blocks - 1}"
            )
        return self._copy_blocks(request_id, destination, source, lora_name, salt, kv_cache)

    def export(
        self, plan: BatchPlan, kv_cache: PagedKVCache, disk: DiskBlocks | None = None
    ) -> tuple[list[OutgoingKv], dict[str, str]]:
        """Copy out the cached blocks the plan exports to other pairs' requests; run before
        the plan's writes, which may reuse them. Blocks the pool evicted come from the KV disk
        tier (`disk`), checked as any disk read is. Returns the transfers and, by request id,
        the exports that cannot be made (each fails alone)."""
        outgoing: list[OutgoingKv] = []
        failed: dict[str, str] = {}
        for export in plan.kv_exports:
            destination = export.destination
            try:
                self.identity.check_destination(destination)
                if len(export.block_ids) != destination.num_blocks:
                    raise KvTransferError(
                        f"kv export has {len(export.block_ids)} blocks for"
                        f" {destination.num_blocks} destination blocks"
                    )
                outgoing.append(
                    self._copy_blocks(
                        export.request_id,
                        destination,
                        export.block_ids,
                        destination.lora_name,
                        destination.cache_salt,
                        kv_cache,
                        _disk_rows(export, disk, kv_cache.spec.bytes_per_block),
                    )
                )
            except KvTransferError as exc:
                failed[export.request_id] = FAILED_TRANSFER_PREFIX + str(exc)
        return outgoing, failed

    def _copy_blocks(
        self,
        request_id: str,
        destination: KvDestination,
        source: list[int],
        lora_name: str,
        salt: bytes,
        kv_cache: PagedKVCache,
        disk_rows: dict[int, bytes] | None = None,
    ) -> OutgoingKv:
        """`source` blocks copied into a shared-memory file when the destination shares this
        host, else into memory for the byte stream; row i from `disk_rows[i]` when given."""
        num_bytes = len(source) * kv_cache.spec.bytes_per_block
        directory = self.transports.shm_directory(destination)
        shm_name = ""
        if directory:
            try:
                shm_name, mapped = kv_transfer_shm.create(directory, num_bytes)
            except OSError:  # full or gone: this transfer takes the byte stream
                directory = ""
        if not directory:
            mapped = torch.empty(num_bytes, dtype=torch.uint8)
        data = mapped.view(len(source), kv_cache.spec.bytes_per_block)
        try:
            if not disk_rows:
                kv_transfer_shm.copy_out(kv_cache, source, data)
            else:
                for i, block_id in enumerate(source):
                    if i in disk_rows:
                        data[i].numpy()[:] = numpy.frombuffer(disk_rows[i], dtype=numpy.uint8)
                    else:
                        kv_transfer_shm.copy_out(kv_cache, [block_id], data[i : i + 1])
        except BaseException:
            if shm_name:
                kv_transfer_shm.remove(directory, shm_name)
            raise
        return OutgoingKv(request_id, destination, lora_name, salt, data, shm_name)


class KvInbox:
    """Decode side: the transfers its scheduler gave up (fallback, abort), whose late writes are
    discarded. The scheduler names such a request among a plan's dropped sequences although
    this worker never held it; `on_plan` and `write` both run on the forward thread, so a write
    lands before the plan that gives the transfer up, or not at all, never in blocks the
    scheduler has handed to another sequence since."""

    MAX_CLOSED = 1 << 16
    """Ids remembered (a late push comes within seconds; the oldest are forgotten first)."""

    def __init__(self, identity: CacheIdentity, worker_epoch: str) -> None:
        self.identity = identity
        self.worker_epoch = worker_epoch
        self._closed: OrderedDict[str, None] = OrderedDict()

    def header_problem(self, theirs: CacheIdentity, worker_epoch: str) -> str | None:
        return self.epoch_problem(worker_epoch) or self.identity.mismatch(theirs)

    def epoch_problem(self, worker_epoch: str) -> str | None:
        if worker_epoch != self.worker_epoch:
            return (
                f"worker_epoch {worker_epoch!r} is not this worker's: it restarted since the"
                " blocks were reserved"
            )
        return None

    def on_plan(self, plan: BatchPlan, sequences: dict[str, CachedSequence]) -> None:
        for request_id in plan.finished_request_ids:
            if request_id not in sequences:
                self._closed[request_id] = None
                if len(self._closed) > self.MAX_CLOSED:
                    self._closed.popitem(last=False)

    def write(
        self, request_id: str, block_ids: list[int], data: torch.Tensor, kv_cache: PagedKVCache
    ) -> bool:
        """Write pushed blocks; False (nothing written) for a transfer given up."""
        if request_id in self._closed:
            return False
        kv_cache.write_blocks(block_ids, data)
        return True


def _disk_rows(export: KvExport, disk: DiskBlocks | None, row_bytes: int) -> dict[int, bytes]:
    """The payloads of the export's blocks on the disk tier, by row; KvTransferError when one
    is gone or fails its check (the receiving pair then computes the prefix)."""
    rows: dict[int, bytes] = {}
    salt, lora_name = export.destination.cache_salt, export.destination.lora_name
    for i, block_id in enumerate(export.block_ids):
        if block_id != ON_DISK:
            continue
        block_hash = export.block_hashes[i] if i < len(export.block_hashes) else b""
        payload = None if disk is None else disk.payload(block_hash, lora_name, salt)
        if payload is None or len(payload) != row_bytes:
            raise KvTransferError(
                f"block {block_hash.hex()[:16]} of the export is no longer on this worker's disk"
            )
        rows[i] = payload
    return rows


def fail(result: StepResult, request_id: str, reason: str) -> None:
    """The sequence's token does not go out: its request ends with `reason` (the decode side,
    hearing an error instead of a first token, prefills the prompt itself)."""
    result.sampled_token_ids.pop(request_id, None)
    result.logprobs.pop(request_id, None)
    result.failed_sequences[request_id] = FAILED_TRANSFER_PREFIX + reason
