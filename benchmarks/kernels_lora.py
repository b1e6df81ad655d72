"""Micro-benchmark of the batched multi-LoRA ops on CPU (kernels/csrc/lora.cpp): a decode
batch (one token per sequence) over 1, 4 or 16 distinct adapters, ms per call of each
SmolLM2-135M projection against the base matmul of the same projection.

    python -m benchmarks.kernels_lora [--batch 16] [--rank 16] [--adapters 1 4 16]
        [--dtype bf16] [--budget-s 0.05] [--repeats 3] [--threads N]

Columns: the base F.linear (x @ W.T), the C++ `lora_apply` (one op: shrink and expand), the
C++ shrink and expand as two ops, and the torch reference (kernels/lora_torch.py). Sequences
take the adapters in turn (slot = sequence % adapters), so every adapter's A and B are read
once per call whatever the batch. Each figure is the fastest call of --repeats rounds with
the methods interleaved (a shared machine skews ratios less than absolute times).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.common import machine_header, time_ms
from kernels import cpu_extension, lora_torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class Projection:
    name: str
    in_features: int
    out_slices: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)


def projections(hidden: int, intermediate: int, kv: int) -> tuple[Projection, ...]:
    return (
        Projection("qkv", hidden, (hidden, kv, kv)),
        Projection("o", hidden, (hidden,)),
        Projection("gate_up", hidden, (intermediate, intermediate)),
        Projection("down", intermediate, (hidden,)),
    )


def calls(
    projection: Projection,
    batch: int,
    adapters: int,
    rank: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> dict[str, Callable[[], object]]:
    num_slices = len(projection.out_slices)
    k, n = projection.in_features, projection.out_features
    x = torch.randn(batch, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    # Adapters beyond those used stay in memory as a server's slots would.
    num_slots = max(adapters, 16)
    lora_a = (torch.randn(num_slots, num_slices * rank, k, generator=generator) / k**0.5).to(dtype)
    lora_b = torch.randn(num_slots, n, rank, generator=generator).to(dtype)
    scales = torch.full((num_slots,), 2.0)
    seg_starts = torch.arange(batch + 1, dtype=torch.int32)
    seg_slots = torch.arange(batch, dtype=torch.int32) % adapters
    y = F.linear(x, weight)
    v = torch.zeros(batch, num_slices * rank)
    out_slices = list(projection.out_slices) if num_slices > 1 else []
    ops = torch.ops.llmserve
    return {
        "base matmul": lambda: F.linear(x, weight),
        "C++ apply": lambda: ops.lora_apply(
            x, lora_a, lora_b, seg_starts, seg_slots, scales, y, out_slices
        ),
        "C++ shrink+expand": lambda: (
            ops.lora_shrink(x, lora_a, seg_starts, seg_slots, v),
            ops.lora_expand(v, lora_b, seg_starts, seg_slots, scales, y, out_slices),
        ),
        "torch reference": lambda: lora_torch.lora_apply(
            x, lora_a, lora_b, seg_starts, seg_slots, scales, y, out_slices or None
        ),
    }


def measure(
    batch: int,
    rank: int,
    adapter_counts: list[int],
    dtype: torch.dtype,
    shapes: tuple[Projection, ...],
    budget_s: float,
    repeats: int,
) -> list[tuple[str, int, dict[str, float]]]:
    rows = []
    for projection in shapes:
        for adapters in adapter_counts:
            fns = calls(projection, batch, adapters, rank, dtype, torch.Generator().manual_seed(0))
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(repeats):
                for name, fn in fns.items():
                    best[name] = min(best[name], time_ms(fn, budget_s))
            rows.append((projection.name, adapters, best))
    return rows


def render(rows: list[tuple[str, int, dict[str, float]]]) -> str:
    names = list(rows[0][2]) if rows else []
    header = ["projection", "adapters", *[f"{name} ms" for name in names], "apply / base"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(names) + 1)]
    for projection, adapters, best in rows:
        cells = [f"{best[name]:.4f}" for name in names]
        ratio = best["C++ apply"] / best["base matmul"]
        lines.append(f"| {projection} | {adapters} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="decode sequences")
    parser.add_argument("--rank", type=int, default=16, help="max rank (padded)")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="k and v rows of q|k|v each")
    parser.add_argument("--budget-s", type=float, default=0.05, help="seconds per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if not cpu_extension.load():
        raise SystemExit("the C++ CPU kernels did not build here")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = projections(args.hidden, args.intermediate, args.kv)
    rows = measure(
        args.batch,
        args.rank,
        args.adapters,
        DTYPES[args.dtype],
        shapes,
        args.budget_s,
        args.repeats,
    )
    print(machine_header(torch_threads=torch.get_num_threads()))
    print(
        f"decode batch {args.batch}, rank {args.rank}, {args.dtype}, "
        f"{torch.get_num_threads()} threads, hidden {args.hidden}, intermediate "
        f"{args.intermediate}"
    )
    print(render(rows))


if __name__ == "__main__":
    main()
