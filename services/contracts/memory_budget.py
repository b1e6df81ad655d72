"""A worker's memory as a budget (Worker.Describe, the start log, `llmserve inspect --load`):
its weights by kind, its KV cache, the runtime (everything else it holds), and what the
machine gives it."""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    weight_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    """Bytes of the weights per storage kind: a GGUF block kind (Q4_K, Q8_0 ...) or a dtype."""
    weight_mapped_bytes: int = 0
    """Of the weights, the bytes read in place from the model file's memory mapping (shared
    with the page cache; the rest are the worker's own buffers)."""
    kv_cache_bytes: int = 0
    kv_cache_blocks: int = 0
    kv_cache_tokens: int = 0
    """Tokens the KV cache holds: blocks x block size."""
    runtime_bytes: int = 0
    """Resident memory that is neither weights nor KV cache: the libraries, the tokenizer,
    activations of the largest step, rope tables, sampler and adapter buffers."""
    machine_bytes: int = 0
    """Memory the worker may use: the container's limit, else the machine's total."""

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_kind.values())

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.runtime_bytes

    def log_fields(self) -> dict[str, object]:
        """Flat fields for a structured log line, in MiB."""
        return {
            "weights_mib": round(self.weight_bytes / MiB, 1),
            "weights_by_kind_mib": {
                k: round(v / MiB, 1) for k, v in self.weight_bytes_by_kind.items()
            },
            "weights_mapped_mib": round(self.weight_mapped_bytes / MiB, 1),
            "kv_cache_mib": round(self.kv_cache_bytes / MiB, 1),
            "kv_cache_blocks": self.kv_cache_blocks,
            "kv_cache_tokens": self.kv_cache_tokens,
            "runtime_mib": round(self.runtime_bytes / MiB, 1),
            "total_mib": round(self.total_bytes / MiB, 1),
            "machine_mib": round(self.machine_bytes / MiB, 1),
        }

    def lines(self) -> list[tuple[str, str]]:
        """(what, how much) rows for a text report."""
        kinds = ", ".join(
            f"{kind} {mib(size)}"
            for kind, size in sorted(self.weight_bytes_by_kind.items(), key=lambda kv: -kv[1])
        )
        share = f" of {mib(self.machine_bytes)}" if self.machine_bytes else ""
        mapped = mib(self.weight_mapped_bytes)
        blocks, tokens = self.kv_cache_blocks, self.kv_cache_tokens
        return [
            ("weights", f"{mib(self.weight_bytes)} ({kinds}; {mapped} mapped from the file)"),
            ("KV cache", f"{mib(self.kv_cache_bytes)} ({blocks} blocks, {tokens} tokens)"),
            ("runtime", mib(self.runtime_bytes)),
            ("total", f"{mib(self.total_bytes)}{share}"),
        ]


def mib(size: int) -> str:
    if size >= 10 * GiB:
        return f"{size / GiB:.1f} GiB"
    return f"{size / MiB:.0f} MiB" if size >= 10 * MiB else f"{size / MiB:.1f} MiB"
