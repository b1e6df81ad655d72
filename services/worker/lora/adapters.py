"""The worker's adapters: loaded names, their host copies (at most max_cpu_loras, least
recently used forgotten first and read again from their file when needed), the device slots
(at most max_loras; the least recently used slot no running sequence holds is taken over),
and which slot each running sequence uses.

Per step (ModelRunner.execute): `admit` resolves the adapter name of each new sequence to a
slot before the batch takes the plan (an adapter that is not loaded, or no free slot, fails
that sequence alone, and it is left out of every later plan until the scheduler drops it);
`batch_for` gives the forward its segment table, or None when no row has an adapter.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.contracts.lora import LoraAdapterInfo
from services.contracts.step import BatchPlan
from services.worker.lora.adapter import LoraAdapter, check_adapter
from services.worker.lora.batch import LoraBatch, lora_batch
from services.worker.lora.errors import LoraAdapterError, LoraConflictError, LoraNotFoundError
from services.worker.lora.gguf_format import is_gguf_file, read_gguf_adapter
from services.worker.lora.peft_format import is_peft_dir, read_peft_adapter
from services.worker.lora.slots import LoraSlots
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.families import family_by_name

log = logging.getLogger(__name__)

NO_SLOT = -1


@dataclass(slots=True)
class _Loaded:
    path: Path
    rank: int
    targets: tuple[str, ...]
    scaling: float
    load_ms: float
    adapter: LoraAdapter | None
    """The host copy; None once forgotten (read again from `path` when a slot needs it)."""


def read_adapter(name: str, path: Path, arch: ModelArchitecture) -> LoraAdapter:
    """Read a PEFT directory or a GGUF LoRA file for the model of `arch`."""
    family = family_by_name(arch.family)
    if is_peft_dir(path):
        return read_peft_adapter(name, path, family)
    if is_gguf_file(path):
        return read_gguf_adapter(name, path, family, arch)
    raise LoraAdapterError(
        "path", f"{path} is neither a PEFT directory (adapter_config.json) nor a .gguf file"
    )


class LoraAdapters:
    def __init__(
        self,
        arch: ModelArchitecture,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
    ) -> None:
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.slots: LoraSlots | None = None
        """The device memory, taken at the first load."""
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        """Least recently used first."""
        self._slot_names: list[str | None] = [None] * max_loras
        self._slot_refs = [0] * max_loras
        self._slot_used_at = [0] * max_loras
        self._clock = 0
        self._sequence_slots: dict[str, int] = {}
        """Running sequences with an adapter -> its slot."""
        self._failed: set[str] = set()
        """Sequences failed at admission, left out of plans until they are dropped."""

    # --- control (the worker's LoadLoraAdapter / UnloadLoraAdapter / ListLoraAdapters) ----

    def load(self, name: str, path: Path) -> LoraAdapterInfo:
        """Read, check and place an adapter (in host memory only when every slot is held by
        running sequences)."""
        if not name:
            raise LoraAdapterError("name", "must not be empty (the empty name is the base model)")
        if self.max_loras == 0:
            raise LoraConflictError("this worker has no LoRA slots (max_loras is 0)")
        if name in self._loaded:
            raise LoraConflictError(
                f"adapter {name!r} is loaded already; unload it first", already_loaded=True
            )
        started = time.perf_counter()
        adapter = read_adapter(name, path, self.arch)
        check_adapter(adapter, self.arch, self.max_lora_rank)
        self._loaded[name] = _Loaded(
            path, adapter.rank, adapter.targets, adapter.scaling, 0.0, adapter
        )
        self._forget_host_copies()
        slot = self._free_slot()
        if slot != NO_SLOT:
            self._place(name, slot)
        load_ms = (time.perf_counter() - started) * 1000
        self._loaded[name].load_ms = load_ms
        log.info(
            "LoRA adapter loaded",
            extra={"lora_name": name, "rank": adapter.rank, "slot": slot, "load_ms": load_ms},
        )
        return self.info(name)

    def unload(self, name: str) -> None:
        if name not in self._loaded:
            raise LoraNotFoundError("name", f"no adapter {name!r} is loaded")
        slot = self._slot_of(name)
        if slot != NO_SLOT:
            if self._slot_refs[slot]:
                raise LoraConflictError(
                    f"adapter {name!r} is used by {self._slot_refs[slot]} running sequences"
                )
            self._slot_names[slot] = None
        del self._loaded[name]
        log.info("LoRA adapter unloaded", extra={"lora_name": name})

    def info(self, name: str) -> LoraAdapterInfo:
        loaded = self._loaded[name]
        slot = self._slot_of(name)
        return LoraAdapterInfo(
            name=name,
            path=str(loaded.path),
            rank=loaded.rank,
            targets=loaded.targets,
            scaling=loaded.scaling,
            load_ms=loaded.load_ms,
            slot=slot,
            num_running=self._slot_refs[slot] if slot != NO_SLOT else 0,
        )

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._loaded)

    def list(self) -> list[LoraAdapterInfo]:
        return [self.info(name) for name in sorted(self._loaded)]

    # --- steps ------------------------------------------------------------------------------

    def admit(self, plan: BatchPlan) -> tuple[BatchPlan, dict[str, str]]:
        """The plan without the sequences that cannot run (failed now or before), and the
        reason of each one failed now. Sequences the plan drops release their slots first (a
        preempted sequence may come back in the same plan)."""
        for request_id in plan.finished_request_ids:
            self._failed.discard(request_id)
            slot = self._sequence_slots.pop(request_id, NO_SLOT)
            if slot != NO_SLOT:
                self._slot_refs[slot] -= 1
        failures: dict[str, str] = {}
        for seq in plan.new_sequences:
            if seq.lora_name:
                try:
                    self._sequence_slots[seq.request_id] = self._acquire(seq.lora_name)
                except (LoraNotFoundError, LoraConflictError, LoraAdapterError) as exc:
                    failures[seq.request_id] = str(exc)
                    self._failed.add(seq.request_id)
        if not self._failed:
            return plan, failures
        return plan.without(self._failed), failures

    @property
    def num_running(self) -> int:
        """Running sequences that use an adapter."""
        return len(self._sequence_slots)

    def batch_for(
        self, request_ids: Sequence[str], row_counts: Sequence[int], device: torch.device
    ) -> LoraBatch | None:
        """The segment table of a step's sequences in token order, with their rows; None
        when no row has an adapter (the forward then does nothing extra)."""
        if not self._sequence_slots:
            return None
        slot_of = self._sequence_slots.get
        rows = [(n, slot_of(rid, NO_SLOT)) for rid, n in zip(request_ids, row_counts, strict=True)]
        if all(slot == NO_SLOT for _, slot in rows):
            return None
        assert self.slots is not None
        return lora_batch(rows, self.slots, device)

    def reset(self) -> None:
        """Forget every sequence (a new scheduler session); adapters stay loaded."""
        self._sequence_slots.clear()
        self._failed.clear()
        self._slot_refs = [0] * self.max_loras

    # --- slots ------------------------------------------------------------------------------

    def allocate_slots(self) -> LoraSlots:
        """The device slots, allocated now if no load has yet (compiled decode steps need their
        tables before the first adapter comes)."""
        if self.slots is None:
            self.slots = LoraSlots(
                self.arch, self.max_loras, self.max_lora_rank, self.dtype, self.device
            )
            log.info("LoRA slots allocated", extra={"bytes": self.slots.num_bytes})
        return self.slots

    def _acquire(self, name: str) -> int:
        """The slot of a loaded adapter, placing it if it has none; one more reference."""
        if name not in self._loaded:
            raise LoraNotFoundError("lora_name", f"no adapter {name!r} is loaded on this worker")
        slot = self._slot_of(name)
        if slot == NO_SLOT:
            slot = self._free_slot()
            if slot == NO_SLOT:
                raise LoraConflictError(
                    f"lora_name: no slot for adapter {name!r}: all {self.max_loras} slots are"
                    " used by running sequences"
                )
            self._place(name, slot)
        self._slot_refs[slot] += 1
        self._touch(name, slot)
        return slot

    def _slot_of(self, name: str) -> int:
        return self._slot_names.index(name) if name in self._slot_names else NO_SLOT

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one no running sequence holds."""
        if None in self._slot_names:
            return self._slot_names.index(None)
        idle = [slot for slot in range(self.max_loras) if self._slot_refs[slot] == 0]
        return min(idle, key=lambda slot: self._slot_used_at[slot]) if idle else NO_SLOT

    def _place(self, name: str, slot: int) -> None:
        loaded = self._loaded[name]
        adapter = loaded.adapter
        if adapter is None:  # forgotten in host memory: read it again
            adapter = read_adapter(name, loaded.path, self.arch)
            check_adapter(adapter, self.arch, self.max_lora_rank)
            loaded.adapter = adapter
            self._forget_host_copies(keep=name)
        slots = self.allocate_slots()
        evicted = self._slot_names[slot]
        if evicted is not None:
            log.info("LoRA adapter left its slot", extra={"lora_name": evicted, "slot": slot})
        slots.write(slot, adapter)
        self._slot_names[slot] = name
        self._touch(name, slot)

    def _touch(self, name: str, slot: int) -> None:
        self._clock += 1
        self._slot_used_at[slot] = self._clock
        self._loaded.move_to_end(name)

    def _forget_host_copies(self, keep: str | None = None) -> None:
        """Keep at most max_cpu_loras host copies, least recently used forgotten first."""
        held = [name for name, loaded in self._loaded.items() if loaded.adapter is not None]
        for name in held[: max(0, len(held) - self.max_cpu_loras)]:
            if name != keep:
                self._loaded[name].adapter = None
