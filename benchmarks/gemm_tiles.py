"""The integer GGUF kernels at real sizes, per format and batch height: ms per call and GOPS of
the 8-row layouts (kernels/csrc/gguf_x8_layout.h) against the file's layout, on the
projections of Llama 3.2 1B (q|k|v 3072 x 2048, gate|up 16384 x 2048, down 2048 x 8192), and
each as a share of the CPU's int8 peak (benchmarks/machine_peaks.py, an upper bound).

    llmserve bench gemm-tiles [--kinds Q4_0,Q8_0,Q4_K,Q6_K] [--m 1,2,4,8,16,32,64,128,256]

M = 1 is a decode step of one sequence, 2-8 speculative verification and small batches, 16-64
decode batches, 128 and up prefill chunks. Weights are random blocks of the kind (the kernels
do the same work whatever the values), reused by every call: at M = 1 they sit in the caches,
so that column is the kernel's own speed, not the memory's. Each figure is the fastest of
--repeats rounds of --budget-s seconds; the two layouts alternate, so a shared machine skews
their ratio less than the times.

    llmserve bench gemm-tiles --from-memory [--memory-mib 1024] [--m 1,2,4,8]

--from-memory is a decode step's view instead: the calls take turns over distinct copies of
the 8-row weights, --memory-mib in all (far more than the last-level cache), so every call
reads its weights from memory, as a model's layers do; the table gives the weight bytes read
per second against the machine's measured read bandwidth (what one user's step can reach).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from time import perf_counter
from typing import Any

import torch

from benchmarks import machine_peaks
from kernels import cpu_extension
from kernels.gguf_blocks_torch import (
    GGUF_KINDS,
    GGUF_REPACKED_X8,
    REPACKABLE_KINDS,
    SCALE_OFFSETS,
    group_shape,
)
from services.worker.huge_pages import HugePageArena

SHAPES = (("q|k|v", 3072, 2048), ("gate|up", 16384, 2048), ("down", 2048, 8192))
DEFAULT_KINDS = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def random_blocks(n: int, k: int, kind: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values, size = group_shape(kind)
    raw = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, generator=generator)
    for offset in SCALE_OFFSETS[kind]:  # finite scales, as a file's are
        scales = torch.randn(n, k // values, 1, generator=generator) * 0.01
        raw[..., offset : offset + 2] = scales.half().view(torch.uint8)
    return raw.view(n, -1).contiguous()


def fastest_ms(call: Callable[[], object], budget_s: float, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started, calls = perf_counter(), 0
        while perf_counter() - started < budget_s:
            call()
            calls += 1
        best = min(best, (perf_counter() - started) / calls)
    return best * 1e3


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    ops = torch.ops.llmserve
    names = args.kinds.split(",")
    unknown = [name for name in names if GGUF_KINDS.get(name) not in REPACKABLE_KINDS]
    if unknown:
        layouts = ", ".join(name for name, kind in GGUF_KINDS.items() if kind in REPACKABLE_KINDS)
        raise SystemExit(f"--kinds: no 8-row layout for {', '.join(unknown)} (one of {layouts})")
    kinds = [GGUF_KINDS[name] for name in names]
    if not cpu_extension.load():
        print("the C++ kernels are unavailable here: nothing to measure")
        return 1
    ms = [int(m) for m in args.m.split(",")]
    peaks = machine_peaks.measure(threads)
    print(f"cpu flags: {cpu_extension.cpu_flags_line()}")
    print(f"kernel isa: {ops.gguf_kernel_isa()}; threads: {threads}")
    print(peaks.int8_line())
    if args.from_memory:
        print(peaks.bandwidth_line())
        print()
        return from_memory_table(args, kinds, ms, peaks.read_bytes_per_s)
    peak = peaks.int8_ops_per_s
    print()
    print("| kind | layer | M | file ms | x8 ms | x8 / file speed | x8 GOPS | % of int8 peak |")
    print("| ---- | ----- | -: | ------: | ----: | --------------: | ------: | -------------: |")
    names = {kind: name for name, kind in GGUF_KINDS.items()}
    for kind in kinds:
        for layer, n, k in SHAPES:
            blocks = random_blocks(n, k, kind)
            repacked = ops.gguf_repack(blocks, kind)
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                file_call = partial(ops.gguf_linear, x, blocks, kind, True, False)
                x8_call = partial(
                    ops.gguf_linear, x, repacked, kind | GGUF_REPACKED_X8, True, False
                )
                file_ms = x8_ms = float("inf")
                for _ in range(args.repeats):  # alternating rounds
                    file_ms = min(file_ms, fastest_ms(file_call, args.budget_s, 1))
                    x8_ms = min(x8_ms, fastest_ms(x8_call, args.budget_s, 1))
                gops = 2 * m * n * k / (x8_ms * 1e-3) / 1e9
                share = f"{100 * gops * 1e9 / peak:.0f}" if peak == peak else "-"
                print(
                    f"| {names[kind]} | {layer} | {m} | {file_ms:.3f} | {x8_ms:.3f} |"
                    f" {file_ms / x8_ms:.2f} | {gops:.0f} | {share} |"
                )
    return 0


def next_call(
    linear: Callable[..., object], x: torch.Tensor, weights: Iterator[torch.Tensor], kind: int
) -> object:
    return linear(x, next(weights), kind, True, False)


def from_memory_table(
    args: argparse.Namespace, kinds: Sequence[int], ms: Sequence[int], read_bytes_per_s: float
) -> int:
    """Each call on the next of distinct weight copies (--memory-mib in all): the weights come
    from memory at every call, as in a decode step over a model's layers."""
    ops = torch.ops.llmserve
    names = {kind: name for name, kind in GGUF_KINDS.items()}
    print("| kind | layer | M | ms | weight GB/s | % of read bandwidth | GOPS |")
    print("| ---- | ----- | -: | -: | ----------: | ------------------: | ---: |")
    for kind in kinds:
        for layer, n, k in SHAPES:
            first = ops.gguf_repack(random_blocks(n, k, kind), kind)
            copies = max(2, args.memory_mib * (1 << 20) // first.numel())
            # Copies of one random tensor (the kernels' work does not depend on the values),
            # back to back on huge pages as a model's weights are.
            arena = HugePageArena(copies * (first.numel() + 64))
            weights = itertools.cycle(
                [arena.take(first.numel()).view_as(first).copy_(first) for _ in range(copies)]
            )
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                call = partial(next_call, ops.gguf_linear, x, weights, kind | GGUF_REPACKED_X8)
                call_ms = fastest_ms(call, args.budget_s, args.repeats)
                bytes_per_s = first.numel() / (call_ms * 1e-3)
                gops = 2 * m * n * k / (call_ms * 1e-3) / 1e9
                print(
                    f"| {names[kind]} | {layer} | {m} | {call_ms:.3f} | {bytes_per_s / 1e9:.1f} |"
                    f" {100 * bytes_per_s / read_bytes_per_s:.0f} | {gops:.0f} |"
                )
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS))
    parser.add_argument("--m", default=",".join(str(m) for m in DEFAULT_M))
    parser.add_argument("--budget-s", type=float, default=0.1, help="seconds per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--from-memory",
        action="store_true",
        help="every call reads its weights from memory (distinct copies in turn)",
    )
    parser.add_argument(
        "--memory-mib", type=int, default=1024, help="--from-memory: the copies' size in all"
    )
    parser.set_defaults(func=run)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gemm-tiles",
        help="the 8-row GGUF kernels per format and batch height at real sizes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
