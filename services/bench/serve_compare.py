"""The in-process engine against the `llmserve up` stack under the same load
(`llmserve bench serve --compare-inprocess`), the pure part: the `llmserve up` flags that give
the stack the engine's settings, and the table of both systems' figures with their ratios.
serve.py runs the two systems; nothing here starts a process or reads a clock.

A ratio is stack / in-process for every figure, so it reads as the cost of the process split:

    TPOT, TTFT (ms)   ratio > 1: the stack is slower     (lower is better)
    output tok/s      ratio < 1: the stack delivers less (higher is better)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.bench.common import format_table
from services.bench.serve_metrics import ServeSummary
from services.bench.sweep import PointResult, SweepPoint, load_order_key

INPROCESS = "inprocess"
STACK = "stack"


def stack_up_flags(
    *,
    model: str | None,
    dtype: str,
    quantization: str | None,
    threads: int | None,
    max_num_seqs: int,
    kv_cache_gib: float | None = None,
    max_num_batched_tokens: int | None = None,
    enforce_eager: bool = False,
    seed: int | None = None,
    tokenizer_replicas: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`llmserve up` flags that give the stack's worker the in-process engine's settings.
    None leaves the stack's own default (the same field default as the engine's: both are
    built from services.common.serving_config). `threads` become the worker's torch threads;
    `extra` is appended last, so it can override anything before it."""
    flags: list[str] = []
    if model is not None:
        flags += ["--model", model]
    flags += ["--dtype", dtype]
    if quantization is not None:
        flags += ["--quantization", quantization]
    if kv_cache_gib is not None:
        flags += ["--kv-cache-gib", f"{kv_cache_gib:g}"]
    flags += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if threads is not None:
        flags += ["--worker-threads", str(threads)]
    if enforce_eager:
        flags.append("--enforce-eager")
    if seed is not None:
        flags += ["--seed", str(seed)]
    if tokenizer_replicas is not None:
        flags += ["--tokenizer-replicas", str(tokenizer_replicas)]
    return flags + list(extra)


# ---- figures and ratios ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SystemFigures:
    """The figures of one system at one load point (latencies in ms)."""

    tpot_p50_ms: float
    ttft_p50_ms: float
    output_tokens_per_s: float
    num_completed: int
    num_requests: int

    @classmethod
    def of(cls, summary: ServeSummary) -> SystemFigures:
        return cls(
            tpot_p50_ms=summary.tpot.p50_ms,
            ttft_p50_ms=summary.ttft.p50_ms,
            output_tokens_per_s=summary.output_tokens_per_s,
            num_completed=summary.num_completed,
            num_requests=summary.num_requests,
        )


def ratio(stack: float, inprocess: float) -> float:
    """stack / in-process; NaN (printed '-') when either side has no positive finite value,
    as a run whose requests all failed has none."""
    if not (math.isfinite(stack) and math.isfinite(inprocess)) or stack <= 0 or inprocess <= 0:
        return math.nan
    return stack / inprocess


@dataclass(frozen=True, slots=True)
class CompareRow:
    """One load point run on both systems."""

    point: SweepPoint
    inprocess: SystemFigures
    stack: SystemFigures

    @property
    def tpot_ratio(self) -> float:
        return ratio(self.stack.tpot_p50_ms, self.inprocess.tpot_p50_ms)

    @property
    def ttft_ratio(self) -> float:
        return ratio(self.stack.ttft_p50_ms, self.inprocess.ttft_p50_ms)

    @property
    def output_tokens_per_s_ratio(self) -> float:
        return ratio(self.stack.output_tokens_per_s, self.inprocess.output_tokens_per_s)


def compare_rows(
    inprocess: Sequence[PointResult], stack: Sequence[PointResult]
) -> list[CompareRow]:
    """Pair the two systems' results point by point (the second system runs the points the
    first ran, in the same order), in load order. A point only one system reached (its run
    was cut short) has no row."""
    rows = []
    for ours, theirs in zip(inprocess, stack, strict=False):
        if ours.point != theirs.point:
            raise ValueError(
                f"the systems ran different loads: {ours.point.label} vs {theirs.point.label}"
            )
        rows.append(
            CompareRow(ours.point, SystemFigures.of(ours.summary), SystemFigures.of(theirs.summary))
        )
    return sorted(rows, key=lambda row: load_order_key(row.point))


COMPARE_HEADERS = [
    "load",
    "requests ok (in-process, stack)",
    "TPOT p50 in-process",
    "TPOT p50 stack",
    "TPOT stack/in-process (x)",
    "TTFT p50 in-process",
    "TTFT p50 stack",
    "TTFT stack/in-process (x)",
    "output tok/s in-process",
    "output tok/s stack",
    "tok/s stack/in-process (x)",
]

COMPARE_LEGEND = (
    "TPOT (ms per output token) and TTFT in ms, p50; every ratio is stack / in-process. "
    "Latencies: lower is better, a ratio > 1 is what the process split costs. "
    "Output tok/s: higher is better, a ratio < 1 is what it costs. '-': not measured."
)


def compare_table_rows(rows: Sequence[CompareRow]) -> list[list[object]]:
    table: list[list[object]] = []
    for row in rows:
        ours, theirs = row.inprocess, row.stack
        table.append(
            [
                row.point.label,
                f"{ours.num_completed}/{ours.num_requests}, "
                f"{theirs.num_completed}/{theirs.num_requests}",
                ours.tpot_p50_ms,
                theirs.tpot_p50_ms,
                row.tpot_ratio,
                ours.ttft_p50_ms,
                theirs.ttft_p50_ms,
                row.ttft_ratio,
                ours.output_tokens_per_s,
                theirs.output_tokens_per_s,
                row.output_tokens_per_s_ratio,
            ]
        )
    return table


def compare_table(rows: Sequence[CompareRow]) -> str:
    """The markdown table and its one-line legend."""
    return format_table(COMPARE_HEADERS, compare_table_rows(rows)) + "\n" + COMPARE_LEGEND


def compare_document(
    rows: Sequence[CompareRow],
    targets: Mapping[str, str],
    stack_command: Sequence[str] | None,
) -> dict[str, Any]:
    """The "compare" section of --json-out (schema: docs/benchmarks.md). NaN stays NaN here;
    the writer turns it into null."""
    return {
        "run_order": list(targets),
        "targets": dict(targets),
        "stack_command": None if stack_command is None else list(stack_command),
        "legend": COMPARE_LEGEND,
        "rows": [
            {
                "label": row.point.label,
                "request_rate": row.point.request_rate,
                "concurrency": row.point.concurrency,
                INPROCESS: asdict(row.inprocess),
                STACK: asdict(row.stack),
                "stack_over_inprocess": {
                    "tpot_p50": row.tpot_ratio,
                    "ttft_p50": row.ttft_ratio,
                    "output_tokens_per_s": row.output_tokens_per_s_ratio,
                },
            }
            for row in rows
        ],
    }
