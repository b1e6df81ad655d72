"""How `llmserve bench serve` (serve.py) runs its load points: the prompts of each point
(build_samples, LoadPlan), one target through its points (run_points) or several targets point
by point and round by round (run_targets), each point's --json-out document, and the header,
title and JSON output every mode of the command shares."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import MASK, command_line, cpu_model_name, median
from benchmarks.process_cpu import ProcessCpu, cpu_rows, cpu_table
from benchmarks.serve_load import Generation, Load, Target, report, run_point, warm_up
from benchmarks.serve_metrics import RequestRecord, Slo
from benchmarks.serve_targets import prompt_tokenizer
from benchmarks.serve_workload import (
    Sample,
    lengths_file,
    shared_prefix,
    sharegpt,
    synthetic_lengths,
    synthetic_of_lengths,
    synthetic_text,
)
from benchmarks.sweep import PointResult, SweepPoint, point_seed, saturation_rates, sweep_points

WARMUP_SEED_OFFSET = 7919  # warm-up prompts differ from the timed ones: no prefix-cache hits


def build_samples(args: argparse.Namespace, num_prompts: int, seed: int) -> list[Sample]:
    dataset: str = args.dataset
    if dataset == "synthetic":
        return synthetic_of_lengths(workload_lengths(args, num_prompts, seed), seed)
    if dataset == "synthetic-text":
        tokenizer = prompt_tokenizer(args)
        return synthetic_text(
            workload_lengths(args, num_prompts, seed),
            seed,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            tokenizer.decode,
        )
    if dataset == "shared-prefix":
        return shared_prefix(
            num_prompts,
            args.prefix_len,
            args.input_len,
            args.output_len,
            seed,
            num_prefixes=args.num_prefixes,
        )
    if dataset.startswith("sharegpt:"):
        tokenizer = prompt_tokenizer(args)
        return sharegpt(
            Path(dataset.removeprefix("sharegpt:")),
            num_prompts,
            lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
            seed,
            output_len=args.sharegpt_output_len,
        )
    raise ValueError(
        f"--dataset is synthetic, synthetic-text, shared-prefix or sharegpt:FILE; got {dataset!r}"
    )


def workload_lengths(
    args: argparse.Namespace, num_prompts: int, seed: int
) -> list[tuple[int, int]]:
    """(prompt, output) lengths of the synthetic datasets."""
    if args.lengths_file:
        return lengths_file(Path(args.lengths_file), num_prompts)
    return synthetic_lengths(
        num_prompts, args.input_len, args.output_len, seed, args.length_dist, args.length_spread
    )


def json_safe(value: Any) -> Any:
    """NaN and infinity become null: the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def point_document(result: PointResult, seed: int, records: Sequence[RequestRecord]) -> Any:
    """One point of the --json-out document (schema: docs/benchmarks.md)."""
    return {
        "label": result.point.label,
        "request_rate": result.point.request_rate,  # inf (all at once) is written as null
        "concurrency": result.point.concurrency,
        "num_prompts": result.num_prompts,
        "seed": seed,
        "summary": asdict(result.summary),
        "requests": [
            {**asdict(record), "ttft_s": record.ttft_s, "tpot_s": record.tpot_s}
            for record in records
        ],
    }


def planned_points(args: argparse.Namespace) -> list[SweepPoint]:
    """The loads given on the command line; `--sweep` adds its rates after the first point."""
    rates: list[float] = args.request_rate
    concurrencies: list[int | None] = list(args.concurrency or [None])
    if args.sweep and (len(concurrencies) > 1 or rates != [math.inf]):
        raise ValueError(
            "--sweep measures the saturated rate and picks its own rates: "
            "give it at most one --concurrency and no --request-rate"
        )
    return sweep_points(rates, concurrencies)


@dataclass(slots=True)
class LoadPlan:
    """What every target is offered: each load point's prompts and the warm-up."""

    args: argparse.Namespace
    slo: Slo
    first_samples: list[Sample]
    warmup: list[Sample]
    num_points: int
    keep_samples: bool = False
    """Keep each point's prompts once drawn, for the other targets to get the very same ones
    (--compare-inprocess, several --target); else a point's prompts are dropped after it, as a
    sweep's add up."""
    drawn: dict[int, list[Sample]] = field(default_factory=dict)

    def samples(self, index: int) -> list[Sample]:
        if index == 0:
            return self.first_samples
        if index in self.drawn:
            return self.drawn[index]
        samples = build_samples(self.args, self.args.num_prompts, point_seed(self.args.seed, index))
        if self.keep_samples:
            self.drawn[index] = samples
        return samples


@dataclass(slots=True)
class SystemRun:
    """What one target measured, in run order: a result and a --json-out point per load."""

    results: list[PointResult] = field(default_factory=list)
    documents: list[Any] = field(default_factory=list)


def measure_point(
    target: Target,
    plan: LoadPlan,
    point: SweepPoint,
    sample_index: int,
    description: str,
    warm: bool,
    processes: ProcessCpu | None = None,
) -> tuple[PointResult, Any]:
    """One load point on one target: the warm-up first when `warm`, then the prompts of
    `sample_index` (LoadPlan.samples), with its report printed; the result and its --json-out
    point."""
    args = plan.args
    samples = plan.samples(sample_index)
    load = Load(point.request_rate, point.concurrency, args.seed)
    print(f"## {description}: {load.describe()}", flush=True)
    # Warmed up first, so the CPU snapshots cover the measured requests only.
    warm_up(target, plan.warmup if warm else (), load.concurrency)
    before = processes.snapshot() if processes is not None else None
    summary, records = run_point(target, samples, load, plan.slo, description=description)
    print(report(summary) + "\n", flush=True)
    if processes is not None and before is not None:
        rows = cpu_rows(before, processes.snapshot(), summary.output_tokens)
        print(f"CPU by process:\n{cpu_table(rows)}\n", flush=True)
    result = PointResult(point, len(samples), summary)
    return result, point_document(result, point_seed(args.seed, sample_index), records)


def swept_points(point: SweepPoint, saturated: Sequence[PointResult]) -> list[SweepPoint] | None:
    """--sweep: the points after the saturated one, at fractions of its median request rate
    (over rounds); None, said on stderr, when that rate gives none."""
    measured = [r.summary.requests_per_s for r in saturated]
    try:
        rates = saturation_rates(median([rate for rate in measured if math.isfinite(rate)]))
    except ValueError as exc:
        print(f"bench serve: --sweep stops: {exc}", file=sys.stderr)
        return None
    return [SweepPoint(rate, point.concurrency) for rate in rates]


def run_points(
    target: Target,
    plan: LoadPlan,
    points: Sequence[SweepPoint],
    sweep: bool,
    name: str = "",
    processes: ProcessCpu | None = None,
) -> SystemRun:
    """Each point in turn, the warm-up before the first; with `sweep` the first point's
    saturated rate sets the points that follow it. With `processes`, each point's report
    also says how much CPU each of them spent per output token."""
    pending = list(points)
    measured = SystemRun()
    prefix = f"{name} " if name else ""
    while pending:
        point = pending.pop(0)
        index = len(measured.results)
        description = f"{prefix}load {index + 1}/{plan.num_points}"
        result, document = measure_point(
            target, plan, point, index, description, index == 0, processes
        )
        measured.results.append(result)
        measured.documents.append(document)
        if sweep and index == 0:
            following = swept_points(point, [result])
            if following is None:
                break
            pending = following
    return measured


def run_targets(
    targets: Mapping[str, Target],
    plan: LoadPlan,
    points: Sequence[SweepPoint],
    sweep: bool,
    num_rounds: int = 1,
) -> dict[str, SystemRun]:
    """Each load point on every target, one target at a time in the order given, each offered
    the same prompts at the same arrival times; the warm-up before each target's first point.
    With `num_rounds` > 1 a point is run round after round, every target in each round, with
    fresh prompts per round (shared by the targets), so a drift of the machine's speed falls
    on every target alike. With `sweep` the first target's saturated rate (median over the
    rounds) sets the points that follow. A target's --json-out points say its label
    ("system") and their round."""
    measured = {label: SystemRun() for label in targets}
    reference = next(iter(targets))
    pending = list(points)
    index = 0
    while pending:
        point = pending.pop(0)
        for round_index in range(num_rounds):
            # One prompt set per (point, round), drawn once (plan.keep_samples) and given to
            # every target; with one round its index is the point's, as for a single target.
            sample_index = index * num_rounds + round_index
            in_round = f" round {round_index + 1}/{num_rounds}" if num_rounds > 1 else ""
            for label, target in targets.items():
                description = f"{label} load {index + 1}/{plan.num_points}{in_round}"
                warm = index == 0 and round_index == 0
                result, document = measure_point(
                    target, plan, point, sample_index, description, warm
                )
                measured[label].results.append(result)
                measured[label].documents.append(
                    {**document, "system": label, "round": round_index + 1}
                )
            plan.drawn.pop(sample_index, None)  # every target has had them
        if sweep and index == 0:
            following = swept_points(point, measured[reference].results)
            if following is None:
                break
            pending = following
        index += 1
    return measured


def header(
    args: argparse.Namespace,
    plan: LoadPlan,
    generation: Generation,
    target_line: str,
    load_at_start: str,
) -> str:
    samples = plan.first_samples
    mean_prompt = sum(s.prompt_len for s in samples) / len(samples)
    mean_output = sum(s.output_len for s in samples) / len(samples)
    return "\n".join(
        [
            f"command: `{command_line()}`",
            target_line,
            f"client cpu: {cpu_model_name()}; {load_at_start}",
            f"workload: {args.dataset}, {len(samples)} requests per load point "
            f"(+{args.warmup} warm-up), mean prompt {mean_prompt:.1f} tokens, mean output "
            f"{mean_output:.1f} tokens, ignore_eos {generation.ignore_eos}, "
            f"temperature {generation.temperature}",
            f"load points: {plan.num_points}"
            + (" (--sweep: saturated first)" if args.sweep else ""),
        ]
    )


def plot_title(args: argparse.Namespace, plan: LoadPlan, what: str) -> str:
    samples = plan.first_samples
    mean_prompt = sum(s.prompt_len for s in samples) / len(samples)
    mean_output = sum(s.output_len for s in samples) / len(samples)
    return f"{what}; {args.dataset} {mean_prompt:.0f}->{mean_output:.0f} tokens"


def write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as sink:
        json.dump(json_safe(document), sink, indent=1)


def all_completed(runs: Sequence[SystemRun]) -> bool:
    return all(result.summary.num_completed for run in runs for result in run.results)


def config_document(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag for --json-out, the API key masked."""
    config = {k: v for k, v in vars(args).items() if k != "func"}
    if config.get("api_key"):
        config["api_key"] = MASK
    return config


def with_access(target_line: str, access_line: str | None) -> str:
    return target_line if access_line is None else f"{target_line}\n{access_line}"
