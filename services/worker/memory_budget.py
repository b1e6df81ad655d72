"""The worker's memory as a budget: what its weights, KV cache and runtime take (measured after
warm-up, for the start log and Describe), the machine's memory, and the refusal at start when
weights + KV cache + runtime cannot fit (vLLM's answer to a gpu_memory_utilization that does
not hold: say the numbers, start nothing).

The runtime share is measured, not modelled: resident memory (VmRSS) less the weights and the
KV cache. After warm-up it holds the libraries (torch alone is ~220 MB resident), the
tokenizer, rope tables and the activations of the largest step, which the worker's malloc
settings keep for the next one (services/worker/host_memory.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from kernels.gguf_blocks_torch import kind_name
from services.contracts.errors import ModelLoadError
from services.contracts.memory_budget import MemoryBudget, mib
from services.worker.kv_cache import PagedKVCache
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFEmbedding, GGUFLinear

RUNTIME_ESTIMATE_BYTES = 400 << 20
"""The runtime share a start assumes before it can measure: torch and the tokenizer (~300 MB
resident) plus a 1B model's largest prefill activations."""


class InsufficientMemoryError(ModelLoadError):
    """Weights + KV cache + runtime exceed the memory the worker may use; the message names
    the numbers and what to lower."""


def _tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(storage kind, tensor) of every weight of one module (not its children)."""
    if isinstance(module, GGUFLinear):
        for part, kind in zip(module.parts, module.kinds, strict=True):
            yield kind_name(kind), part
        if module.bias is not None:
            yield str(module.bias.dtype).removeprefix("torch."), module.bias
        return
    if isinstance(module, GGUFEmbedding):
        yield kind_name(module.kind), module.blocks
        return
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if tensor is not None:
            yield str(tensor.dtype).removeprefix("torch."), tensor


def file_mappings(path: Path | None) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mappings of `path` (/proc/self/maps)."""
    if path is None:
        return []
    target = str(path.resolve())
    ranges = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = fields[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def weight_bytes(model: CausalLM, model_file: Path | None = None) -> tuple[dict[str, int], int]:
    """(bytes per storage kind, bytes mapped from `model_file`) of the model's weights; a
    buffer shared by two layers (a tied embedding and head) counts once. Rope tables are
    runtime, not weights."""
    mapped_ranges = file_mappings(model_file)
    seen: set[int] = set()
    by_kind: dict[str, int] = {}
    mapped = 0
    skipped = {id(model.rope), id(model.local_rope)}
    for module in model.modules():
        for kind, tensor in _tensors(module):
            if id(tensor) in skipped or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in seen:
                continue
            seen.add(address)
            size = storage.nbytes()
            kind = kind.removesuffix(" x8")  # the same bytes regrouped
            by_kind[kind] = by_kind.get(kind, 0) + size
            if any(start <= address < end for start, end in mapped_ranges):
                mapped += size
    return by_kind, mapped


def resident_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0])
    return 0


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    return 0


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's cgroup v2 memory, when it has a limit."""
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        group = Path("/sys/fs/cgroup") / relative.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit), int((group / "memory.current").read_text().strip())
    except (OSError, IndexError, ValueError):
        return None


def machine_bytes() -> int:
    """Memory the worker may use at most: the container's limit, else the machine's total."""
    total = _meminfo_bytes("MemTotal")
    cgroup = _cgroup_limit()
    return min(total, cgroup[0]) if cgroup else total


def available_bytes() -> int:
    """Memory a start may still take: the machine's available memory, within the container's
    remaining limit."""
    available = _meminfo_bytes("MemAvailable")
    cgroup = _cgroup_limit()
    return min(available, cgroup[0] - cgroup[1]) if cgroup else available


def check_fits(
    *, weight_bytes: int, kv_cache_bytes: int, runtime_bytes: int, available: int
) -> None:
    """Refuse a start whose weights + KV cache + runtime exceed the available memory."""
    needed = weight_bytes + kv_cache_bytes + runtime_bytes
    if needed <= available:
        return
    raise InsufficientMemoryError(
        f"not enough memory: weights {mib(weight_bytes)} + KV cache {mib(kv_cache_bytes)}"
        f" (--kv-cache-gib) + runtime ~{mib(runtime_bytes)} = {mib(needed)}, but"
        f" {mib(available)} is available; lower --kv-cache-gib, or serve a smaller or more"
        " quantized model"
    )


def estimated_weight_bytes(path: Path, quantization: str, dtype: torch.dtype) -> int:
    """What the weights will take, before loading them: a GGUF file's blocks as stored (its
    other tensors in `dtype`); float weights at `dtype`'s size (the int8/int4/nf4 formats are
    made from them, so that is also their load's peak)."""
    item = torch.empty((), dtype=dtype).element_size()
    if path.suffix == ".gguf":
        from kernels.gguf_blocks_torch import GGUF_KINDS
        from services.common.gguf_index import open_gguf_index

        native = set(GGUF_KINDS.values()) if quantization in ("gguf", "gguf-exact") else set()
        return sum(
            tensor.num_bytes if tensor.type_id in native else tensor.num_values * item
            for tensor in open_gguf_index(path).tensors
        )
    from safetensors import safe_open

    from services.worker.loader.hf_loader import safetensors_files

    values = 0
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                values += math.prod(handle.get_slice(name).get_shape())
    return values * item


def measure(model: CausalLM, kv_cache: PagedKVCache, model_file: Path | None) -> MemoryBudget:
    """The budget as it stands (call after warm-up: the runtime share then includes a step's
    activations, and every weight page has been read once)."""
    by_kind, mapped = weight_bytes(model, model_file)
    kv_bytes = kv_cache.num_blocks * kv_cache.spec.bytes_per_block
    runtime = max(0, resident_bytes() - sum(by_kind.values()) - kv_bytes)
    return MemoryBudget(
        weight_bytes_by_kind=by_kind,
        weight_mapped_bytes=mapped,
        kv_cache_bytes=kv_bytes,
        kv_cache_blocks=kv_cache.num_blocks,
        kv_cache_tokens=kv_cache.num_blocks * kv_cache.spec.block_size,
        runtime_bytes=runtime,
        machine_bytes=machine_bytes(),
    )
