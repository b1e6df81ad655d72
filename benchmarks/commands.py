"""`llmserve bench ...`: one subcommand per benchmark module."""

from __future__ import annotations

from typing import Any

from benchmarks import (
    capacity,
    detokenize,
    disagg,
    gemm_tiles,
    hf_baseline,
    interleaved,
    lora,
    memory,
    offline_table,
    peers,
    prefix_cache,
    prefix_tiers,
    quant_table,
    serve,
    spec,
    speculative,
    step_profile,
    structured,
    tenants,
    verify_rows,
)

BENCHMARKS = (
    offline_table,
    capacity,
    hf_baseline,
    serve,
    prefix_cache,
    prefix_tiers,
    quant_table,
    peers,
    step_profile,
    structured,
    detokenize,
    interleaved,
    disagg,
    speculative,
    spec,
    tenants,
    lora,
    memory,
    gemm_tiles,
    verify_rows,
)


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for benchmark in BENCHMARKS:
        benchmark.add_parser(bench_sub)
