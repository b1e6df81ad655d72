"""A LoRA adapter as the worker reports it and the scheduler passes it on (lora.proto's
LoraAdapterInfo; services/common/lora_proto.py maps the message)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    """Module names it adapts (q_proj, v_proj, ...)."""
    scaling: float
    load_ms: float
    """Read, check and place, at load."""
    slot: int
    """Its device slot, -1 while it waits in host memory."""
    num_running: int
    """Running sequences that use it."""
