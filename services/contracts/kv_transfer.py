"""Where a prompt's KV goes after a remote prefill (docs/disaggregation.md) or a prefix export
(docs/prefix-cache.md): the blocks the receiving pair reserved, and the cache facts both workers
must share for the bytes to mean the same."""

from __future__ import annotations

from dataclasses import dataclass, field

FAILED_TRANSFER_PREFIX = "kv transfer: "
"""Starts the reason of a sequence failed because its KV could not be sent (StepResult
.failed_sequences): its request ends UNAVAILABLE, not as an unservable one."""


@dataclass(frozen=True, slots=True)
class KvDestination:
    worker: str
    """The decode worker's address (host:port): the prefill worker pushes the blocks there."""
    first_block: int
    """Blocks of the prompt before this one are cached on the decode side: not sent."""
    block_ids: list[int] = field(default_factory=list)
    """The decode worker's blocks for prompt blocks first_block, first_block + 1, ..."""
    model_name: str = ""
    kv_cache_dtype: str = ""
    block_size: int = 0
    lora_name: str = ""
    """The decode request's adapter and salt: the prefill sequence must have the same."""
    cache_salt: bytes = b""
    worker_epoch: str = ""
    """The decode worker's epoch at reservation: a restarted worker refuses the transfer."""
    host_identity: str = ""
    """The decode worker's host (WorkerDescription.host_identity): a prefill worker on the
    same one hands the blocks over through shared memory; empty = never."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class KvExport:
    """Cached blocks of one pair sent to another pair's request (docs/prefix-cache.md, Prefix
    fetch): the exporting worker copies them out before the plan's writes and pushes them as
    it pushes a prefill's KV, under the receiving request's id."""

    request_id: str
    block_ids: list[int]
    """The exporting worker's blocks, in prefix order: one per destination block; ON_DISK for
    a block its pool evicted and its KV disk tier keeps."""
    destination: KvDestination
    block_hashes: list[bytes] = field(default_factory=list)
    """The blocks' chain hashes, parallel to block_ids: a block on disk is read by its hash."""


ON_DISK = -1
"""A KvExport block id: read the block from the exporting worker's KV disk tier."""
