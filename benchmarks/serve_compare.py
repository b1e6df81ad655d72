"""Several systems under the same load, side by side, the pure part: `llmserve bench serve`
with several --target, and --compare-inprocess (the `llmserve up` stack against the in-process
engine, with the `llmserve up` flags that give the stack the engine's settings). Each system's
figures at each load point (medians over rounds), and one table with a row per (load point,
system) and its ratios to the reference system. serve.py runs the systems; nothing here starts
a process or reads a clock.

A ratio is system / reference for every figure:

    TPOT, TTFT (ms)   ratio > 1: slower than the reference        (lower is better)
    output tok/s      ratio < 1: delivers less than the reference (higher is better)

The reference is the first --target; with --compare-inprocess it is the in-process engine, so
the stack's ratios read as the cost of the process split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import format_table, median
from benchmarks.serve_metrics import ServeSummary
from benchmarks.sweep import PointResult, SweepPoint, load_order_key

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
    """The figures of one system at one load point (latencies in ms). Over several rounds each
    figure is the median of the rounds' and the counts are their sums."""

    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    num_completed: int
    num_requests: int
    errors: dict[str, int] = field(default_factory=dict)
    """Failed requests by status."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Of `prompt_tokens`, those the server reported serving from its prefix cache."""
    num_rounds: int = 1

    @classmethod
    def of(cls, summary: ServeSummary) -> SystemFigures:
        return cls(
            output_tokens_per_s=summary.output_tokens_per_s,
            ttft_p50_ms=summary.ttft.p50_ms,
            ttft_p99_ms=summary.ttft.p99_ms,
            tpot_p50_ms=summary.tpot.p50_ms,
            tpot_p99_ms=summary.tpot.p99_ms,
            num_completed=summary.num_completed,
            num_requests=summary.num_requests,
            errors=dict(summary.errors),
            prompt_tokens=summary.prompt_tokens,
            cached_prompt_tokens=summary.cached_prompt_tokens,
        )

    @classmethod
    def over_rounds(cls, rounds: Sequence[SystemFigures]) -> SystemFigures:
        """Medians of the rounds' figures (over the rounds that measured each: NaN, as a round
        whose requests all failed gives, is left out), sums of their counts."""
        if not rounds:
            raise ValueError("no round to summarize")

        def middle(values: Sequence[float]) -> float:
            return median([value for value in values if math.isfinite(value)])

        errors: dict[str, int] = {}
        for figures in rounds:
            for status, count in figures.errors.items():
                errors[status] = errors.get(status, 0) + count
        return cls(
            output_tokens_per_s=middle([f.output_tokens_per_s for f in rounds]),
            ttft_p50_ms=middle([f.ttft_p50_ms for f in rounds]),
            ttft_p99_ms=middle([f.ttft_p99_ms for f in rounds]),
            tpot_p50_ms=middle([f.tpot_p50_ms for f in rounds]),
            tpot_p99_ms=middle([f.tpot_p99_ms for f in rounds]),
            num_completed=sum(f.num_completed for f in rounds),
            num_requests=sum(f.num_requests for f in rounds),
            errors=dict(sorted(errors.items(), key=lambda item: -item[1])),
            prompt_tokens=sum(f.prompt_tokens for f in rounds),
            cached_prompt_tokens=sum(f.cached_prompt_tokens for f in rounds),
            num_rounds=sum(f.num_rounds for f in rounds),
        )

    @property
    def cached_prompt_percent(self) -> float:
        if self.prompt_tokens <= 0:
            return math.nan
        return 100 * self.cached_prompt_tokens / self.prompt_tokens


def ratio(value: float, reference: float) -> float:
    """value / reference; NaN (printed '-') when either side has no positive finite value, as a
    run whose requests all failed has none."""
    if not (math.isfinite(value) and math.isfinite(reference)) or value <= 0 or reference <= 0:
        return math.nan
    return value / reference


@dataclass(frozen=True, slots=True)
class SystemRow:
    """One system at one load point, beside the reference system's figures there."""

    point: SweepPoint
    system: str
    figures: SystemFigures
    reference: SystemFigures

    @property
    def tpot_ratio(self) -> float:
        return ratio(self.figures.tpot_p50_ms, self.reference.tpot_p50_ms)

    @property
    def ttft_ratio(self) -> float:
        return ratio(self.figures.ttft_p50_ms, self.reference.ttft_p50_ms)

    @property
    def output_tokens_per_s_ratio(self) -> float:
        return ratio(self.figures.output_tokens_per_s, self.reference.output_tokens_per_s)


def figures_by_point(results: Sequence[PointResult]) -> dict[SweepPoint, SystemFigures]:
    """One system's results (a point repeated once per round) -> its figures at each point, in
    the order the points were first run."""
    rounds: dict[SweepPoint, list[SystemFigures]] = {}
    for result in results:
        rounds.setdefault(result.point, []).append(SystemFigures.of(result.summary))
    return {point: SystemFigures.over_rounds(figures) for point, figures in rounds.items()}


def system_rows(results: Mapping[str, Sequence[PointResult]], reference: str) -> list[SystemRow]:
    """A row per (load point, system), in load order, the reference system first at each point
    and the others in the mapping's order. A point that not every system reached (a run cut
    short) has no rows; a system that ran a point the reference did not is an error."""
    if reference not in results:
        raise ValueError(f"the reference {reference!r} is not among the systems")
    figures = {name: figures_by_point(system) for name, system in results.items()}
    reference_points = figures[reference]
    for name, points in figures.items():
        for point in points:
            if point not in reference_points:
                raise ValueError(
                    f"the systems ran different loads: {name} ran {point.label}, "
                    f"{reference} did not"
                )
    names = [reference, *(name for name in results if name != reference)]
    rows: list[SystemRow] = []
    for point, reference_figures in reference_points.items():
        if all(point in figures[name] for name in names):
            rows.extend(
                SystemRow(point, name, figures[name][point], reference_figures) for name in names
            )
    return sorted(rows, key=lambda row: load_order_key(row.point))


COMPARE_HEADERS = [
    "load",
    "target",
    "requests ok",
    "errors",
    "output tok/s",
    "tok/s ratio (x)",
    "TTFT p50",
    "TTFT p99",
    "TTFT p50 ratio (x)",
    "TPOT p50",
    "TPOT p50 ratio (x)",
    "prompt cached %",
]


def compare_legend(reference: str, num_rounds: int = 1) -> str:
    """The lines printed under the table."""
    rounds = (
        f" Figures are medians over {num_rounds} rounds; requests and errors are summed."
        if num_rounds > 1
        else ""
    )
    return (
        f"TTFT and TPOT (ms per output token) in ms; every ratio is the row's target / "
        f"{reference} at the same load. Latencies: lower is better, a ratio > 1 is slower. "
        f"Output tok/s: higher is better, a ratio < 1 delivers less.{rounds} "
        "Prompt cached %: prompt tokens the target reported serving from its prefix cache. "
        "'-': not measured."
    )


def errors_cell(errors: Mapping[str, int]) -> str:
    return ", ".join(f"{status}: {count}" for status, count in errors.items()) or "0"


def compare_table_rows(rows: Sequence[SystemRow]) -> list[list[object]]:
    table: list[list[object]] = []
    for row in rows:
        figures = row.figures
        table.append(
            [
                row.point.label,
                row.system,
                f"{figures.num_completed}/{figures.num_requests}",
                errors_cell(figures.errors),
                figures.output_tokens_per_s,
                row.output_tokens_per_s_ratio,
                figures.ttft_p50_ms,
                figures.ttft_p99_ms,
                row.ttft_ratio,
                figures.tpot_p50_ms,
                row.tpot_ratio,
                figures.cached_prompt_percent,
            ]
        )
    return table


def compare_table(rows: Sequence[SystemRow], reference: str, num_rounds: int = 1) -> str:
    """The markdown table and its legend."""
    table = format_table(COMPARE_HEADERS, compare_table_rows(rows))
    return table + "\n" + compare_legend(reference, num_rounds)


def compare_document(
    rows: Sequence[SystemRow],
    targets: Mapping[str, str],
    reference: str,
    stack_command: Sequence[str] | None = None,
    num_rounds: int = 1,
) -> dict[str, Any]:
    """The "compare" section of --json-out (schema: docs/benchmarks.md). NaN stays NaN here;
    the writer turns it into null."""
    return {
        "reference": reference,
        "run_order": list(targets),
        "targets": dict(targets),
        "stack_command": None if stack_command is None else list(stack_command),
        "rounds": num_rounds,
        "legend": compare_legend(reference, num_rounds),
        "rows": [
            {
                "label": row.point.label,
                "request_rate": row.point.request_rate,
                "concurrency": row.point.concurrency,
                "target": row.system,
                **asdict(row.figures),
                "over_reference": {
                    "tpot_p50": row.tpot_ratio,
                    "ttft_p50": row.ttft_ratio,
                    "output_tokens_per_s": row.output_tokens_per_s_ratio,
                },
            }
            for row in rows
        ],
    }
