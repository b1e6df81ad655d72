"""What a worker says about itself (Worker.Describe): its scheduler sizes the KV manager from
it, keys the prefix index by its epoch, and passes the model part on to the tokenizer tier."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.memory_budget import MemoryBudget
from services.contracts.model_description import ModelDescription


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    model: ModelDescription
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    block_size: int = 0
    """Tokens per KV block."""
    num_kv_blocks: int = 0
    """What the worker allocated from its KV budget."""
    kv_cache_dtype: str = ""
    quantization: str = ""
    worker_epoch: str = ""
    """Changes when the worker restarts: its KV cache is empty."""
    sliding_window: int = 0
    """The window every layer attends through (a query at p sees keys p - W < j <= p), 0 when
    some layer sees the whole context: the scheduler frees blocks before it, never read."""
    max_loras: int = 0
    """LoRA adapters one step may mix (the worker's device slots); 0 = no adapters."""
    max_lora_rank: int = 0
    """Largest rank of an adapter the worker loads."""
    batch_invariant: bool = False
    """Each row's result is independent of the batch (docs/determinism.md): verifying drafts
    leaves greedy output as it is, so speculation is on by default on such a worker."""
    memory: MemoryBudget = field(default_factory=MemoryBudget)
    """Weights, KV cache and runtime bytes, measured after the worker's warm-up."""
    kv_disk_block_hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of the blocks in the worker's KV disk tier (empty: none, or no tier);
    StepResult.disk_added / disk_evicted report what changes after."""
    kv_disk_tier: bool = False
    """A KV disk tier is open (--kv-disk-dir): the scheduler sends it the blocks it caches."""
    host_identity: str = ""
    """Boot id, hostname and shared-memory directory of the worker's host (empty: no shared
    memory): a prefill worker on the same one hands KV over through a file (disaggregation)."""
