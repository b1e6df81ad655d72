"""The one table of `llmserve bench peers`: its rows (measures), and per llama.cpp column the
ratio of the best llmserve column on the same file. Pure: values in, markdown out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.common import format_table
from benchmarks.compare import WORKLOADS, EngineSpec, PeersConfig


@dataclass(frozen=True, slots=True)
class Measure:
    """One row of the table."""

    key: str
    workload: str
    label: str
    higher_is_better: bool


def measures(config: PeersConfig, workloads: Sequence[str] = WORKLOADS) -> list[Measure]:
    shape = f"{config.input_len}/{config.output_len}"
    users = f"{config.num_users} users x {config.requests_per_user}"
    rows = [
        Measure("a_tpot_ms", "a", f"a. 1 user {shape}: TPOT p50 ms", False),
        Measure("a_ttft_ms", "a", f"a. 1 user {shape}: TTFT p50 ms", False),
        Measure("b_output_tok_s", "b", f"b. {users} {shape}: output tok/s", True),
        Measure("b_ttft_ms", "b", f"b. {users} {shape}: TTFT p50 ms", False),
        Measure(
            "c_output_tok_s",
            "c",
            f"c. offline {config.offline_batch} x {shape}: output tok/s",
            True,
        ),
        Measure(
            "c_total_tok_s", "c", f"c. offline {config.offline_batch} x {shape}: total tok/s", True
        ),
    ]
    rows += [
        Measure(f"d_prefill_{n}_tok_s", "d", f"d. prefill {n} tokens, batch 1: tok/s", True)
        for n in config.prefill_lens
    ]
    return [measure for measure in rows if measure.workload in workloads]


def advantage(ours: float, theirs: float, higher_is_better: bool) -> float:
    """How many times better llmserve is: > 1 means llmserve ahead, whichever the direction
    (ours/theirs for throughputs, theirs/ours for latencies)."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or ours <= 0 or theirs <= 0:
        return math.nan
    return ours / theirs if higher_is_better else theirs / ours


def best_llmserve(
    measure: Measure,
    engines: Sequence[EngineSpec],
    values: Mapping[str, Mapping[str, float]],
    file: str | None = None,
) -> tuple[EngineSpec | None, float]:
    """The llmserve column with the best value of this measure (on `file` only, when given),
    and that value."""
    best: tuple[EngineSpec | None, float] = (None, math.nan)
    for engine in engines:
        if not engine.is_llmserve or (file is not None and engine.file != file):
            continue
        value = values.get(engine.name, {}).get(measure.key, math.nan)
        if not math.isfinite(value):
            continue
        current = best[1]
        better = value > current if measure.higher_is_better else value < current
        if best[0] is None or better:
            best = (engine, value)
    return best


RATIO_LEGEND = (
    "best llmserve: the llmserve column with the best value of the row. best vs llama.cpp (x): "
    "how many times better the best llmserve value on the same file is than llama.cpp's (any "
    "file when llmserve did not run that one), > 1 = llmserve ahead (throughputs: ours / "
    "theirs; latencies: theirs / ours). '-': not measured or failed."
)


def peers_table(
    table_measures: Sequence[Measure],
    engines: Sequence[EngineSpec],
    values: Mapping[str, Mapping[str, float]],
) -> str:
    """Rows = measures, columns = engines, then which llmserve column is best and its ratio
    to each llama.cpp column (> 1: llmserve better). A missing value prints as '-'."""
    references = [engine for engine in engines if not engine.is_llmserve]
    has_llmserve = any(engine.is_llmserve for engine in engines)
    headers = ["measure", "better", *(engine.title for engine in engines)]
    if has_llmserve and references:
        headers.append("best llmserve")
        headers += [f"best vs {engine.title} (x)" for engine in references]
    rows: list[list[object]] = []
    for measure in table_measures:
        row: list[object] = [measure.label, "higher" if measure.higher_is_better else "lower"]
        row += [values.get(e.name, {}).get(measure.key, math.nan) for e in engines]
        if has_llmserve and references:
            best, _ = best_llmserve(measure, engines, values)
            row.append(best.title if best is not None else "-")
            files = {engine.file for engine in engines if engine.is_llmserve}
            for reference in references:
                theirs = values.get(reference.name, {}).get(measure.key, math.nan)
                same = reference.file if reference.file in files else None
                _, on_file = best_llmserve(measure, engines, values, same)
                row.append(advantage(on_file, theirs, measure.higher_is_better))
        rows.append(row)
    return format_table(headers, rows)


def workload_settings(config: PeersConfig) -> str:
    """The settings every engine ran with, as one line above a table."""
    return (
        f"{config.threads} threads per engine, one engine loaded at a time; llmserve dtype "
        f"{config.dtype}{', enforce_eager' if config.enforce_eager else ''}; "
        f"a: {config.single_user_prompts} requests one at a time; b: concurrency "
        f"{config.num_users}, {config.multi_user_prompts} requests; token-id prompts, greedy, "
        f"EOS ignored; c, d: median of {config.repeats}"
    )


def settings_line(config: PeersConfig, engines: Sequence[EngineSpec]) -> str:
    models = ", ".join(sorted({f"{e.title}: {e.model.name}" for e in engines}))
    return f"{workload_settings(config)}; files: {models}"
