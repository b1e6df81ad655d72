"""What a tokenizer replica knows of one scheduler: its last GetStats answer, as the fields
routing, model listings and health read (the pool converts the proto as it arrives)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    scheduler_id: str
    worker_epoch: str
    """Changes when the scheduler's worker restarts (its KV cache is then empty)."""
    block_size: int
    """Tokens per KV block: what the prefix hashes cover."""
    num_running: int
    num_waiting: int
    num_free_blocks: int
    dtype: str
    """The worker's, as its Describe reports them (ListModels shows them)."""
    kv_cache_dtype: str
    quantization: str
    lora_adapters: frozenset[str] = frozenset()
    """The LoRA adapters its worker holds: requests naming one may be routed here."""
    active_lora_adapters: frozenset[str] = frozenset()
    """Those in a device slot now (running requests use them): routing prefers these, since a
    request for another one waits for a slot and a copy to the device."""
    max_loras: int = 0
    """Device slots for adapters (0: the worker serves the base model only)."""
    role: str = "both"
    """both, prefill or decode (routing/disaggregation.py)."""
