"""A LoRA adapter as the tokenizer tier reports it: one scheduler's answer, or the pool's merge
of them (adapters.py). scheduler_convert.py reads it from a scheduler's LoraAdapterInfo,
../convert.py writes the public one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: str = ""
    """A PEFT directory or a GGUF LoRA file, on the workers' machines."""
    rank: int = 0
    targets: tuple[str, ...] = ()
    """The model's modules it adapts (q_proj, v_proj, ...)."""
    scaling: float = 0.0
    load_ms: float = 0.0
    """Its load on a scheduler's worker; merged: the slowest worker's."""
    num_running: int = 0
    """Running sequences that use it; merged: over the pool."""
    parent: str = ""
    """The base model's name (set by this tier)."""
    num_loaded_schedulers: int = 0
    """Merged: the schedulers whose workers hold it."""
