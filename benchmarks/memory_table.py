"""`llmserve bench memory`'s pure half: the KV capacity both engines are given (llama-server's
f16 cache for a context, read from the file's metadata), one result per engine and file, and
the table and notes printed from them (benchmarks/memory.py runs the processes)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import MiB, format_table

GiB = 1 << 30
KV_ELEMENT_BYTES = 2  # f16, llama-server's default cache type (and ours for GGUF on a CPU)


# ---- KV capacity -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What decides a model's KV bytes per token, from its GGUF metadata."""

    num_layers: int
    num_kv_heads: tuple[int, ...]
    """Per layer (GGUF may give one count for all, or one per layer)."""
    key_length: int
    value_length: int
    sliding_window: int = 0

    def bytes_per_token(self, element_bytes: int = KV_ELEMENT_BYTES) -> int:
        """K and V of every layer for one token."""
        per_head = (self.key_length + self.value_length) * element_bytes
        return sum(heads * per_head for heads in self.num_kv_heads)

    def cache_bytes(self, num_tokens: int, element_bytes: int = KV_ELEMENT_BYTES) -> int:
        return num_tokens * self.bytes_per_token(element_bytes)


def kv_geometry(metadata: Mapping[str, Any]) -> KVGeometry:
    """From GGUF keys (`general.architecture`, then ARCH.block_count, ARCH.attention.*)."""
    arch = str(metadata["general.architecture"])

    def key(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    num_layers = int(key("block_count"))
    heads = key("attention.head_count")
    heads = int(heads[0] if isinstance(heads, (list, tuple)) else heads)
    kv_heads = key("attention.head_count_kv")
    if kv_heads is None:
        kv_heads = heads
    per_layer = (
        tuple(int(h) for h in kv_heads)
        if isinstance(kv_heads, (list, tuple))
        else (int(kv_heads),) * num_layers
    )
    if len(per_layer) != num_layers:
        raise ValueError(f"{len(per_layer)} KV head counts for {num_layers} layers")
    head_dim = int(key("embedding_length")) // heads
    key_length = int(key("attention.key_length") or head_dim)
    value_length = int(key("attention.value_length") or key_length)
    window = int(key("attention.sliding_window") or 0)
    return KVGeometry(num_layers, per_layer, key_length, value_length, window)


def kv_cache_gib(cache_bytes: int) -> float:
    """The --kv-cache-gib value that gives the worker `cache_bytes` (the worker takes
    int(gib * 2**30) bytes: a power-of-two division, so the value round-trips exactly)."""
    return cache_bytes / GiB


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The key-value header of a GGUF file (tensor data is not read)."""
    from services.common.gguf_metadata import read_metadata

    return dict(read_metadata(path))


# ---- results -----------------------------------------------------------------------------


@dataclass(slots=True)
class EngineMemory:
    """One engine on one file: how long it took to be ready and what it held."""

    engine: str
    command: list[str] = field(default_factory=list)
    ready_s: float = math.nan
    peak_mib: float = math.nan
    """Sum of VmHWM over the process tree: start-up and the request included."""
    ready_rss_mib: float = math.nan
    steady_rss_mib: float = math.nan
    """VmRSS of the tree after one short request."""
    steady_anon_mib: float = math.nan
    steady_file_mib: float = math.nan
    """File-backed pages (a memory-mapped model file) within the steady RSS."""
    num_processes: int = 0
    kv_tokens: int = 0
    """The KV capacity the engine reports (llmserve: blocks x block size)."""
    kv_mib: float = math.nan
    """Its KV bytes: llmserve's from Describe, llama-server's from its log."""
    generated_tokens: int = 0
    log: str = ""
    error: str | None = None

    @property
    def peak_over_steady(self) -> float:
        return self.peak_mib / self.steady_rss_mib if self.steady_rss_mib else math.nan


@dataclass(slots=True)
class FileMemory:
    label: str
    path: str
    size_mib: float
    kv_bytes: int
    """What both engines were given: CONTEXT tokens of f16 K and V."""
    engines: dict[str, EngineMemory] = field(default_factory=dict)


def mib(kib: int) -> float:
    return kib * 1024 / MiB


def ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


TABLE_HEADERS = [
    "file",
    "size MiB",
    "KV MiB",
    "llmserve peak MiB",
    "llmserve steady MiB",
    "llmserve ready s",
    "llama-server peak MiB",
    "llama-server steady MiB",
    "llama-server ready s",
    "steady ratio",
    "llmserve peak/steady",
    "llama-server peak/steady",
]


def memory_table(files: Sequence[FileMemory]) -> str:
    """One row per file; 'steady ratio' is llmserve's steady RSS over llama-server's."""
    rows = []
    nothing = EngineMemory("")
    for entry in files:
        ours = entry.engines.get("llmserve", nothing)
        theirs = entry.engines.get("llama-server", nothing)
        rows.append(
            [
                entry.label,
                entry.size_mib,
                entry.kv_bytes / MiB,
                ours.peak_mib,
                ours.steady_rss_mib,
                ours.ready_s,
                theirs.peak_mib,
                theirs.steady_rss_mib,
                theirs.ready_s,
                ratio(ours.steady_rss_mib, theirs.steady_rss_mib),
                ours.peak_over_steady,
                theirs.peak_over_steady,
            ]
        )
    return format_table(TABLE_HEADERS, rows)


def tree_notes(files: Sequence[FileMemory]) -> list[str]:
    """A line for each engine whose process had children: its peak is a sum, an upper bound."""
    return [
        f"{entry.label} {name}: {result.num_processes} processes in the tree (a first start"
        " builds the C++ kernels with compiler processes); its peak is the sum of theirs, and"
        " its ready time includes the build: run again for a start from the cache"
        for entry in files
        for name, result in entry.engines.items()
        if result.num_processes > 1
    ]
