"""Serving benchmark: a load generator that streams requests to a target and reports TTFT,
TPOT, ITL, end-to-end latency, throughput and goodput (see serve_metrics.py).

llmserve bench serve --target grpc://127.0.0.1:50051 --num-prompts 64 --concurrency 8
llmserve bench serve --target http://127.0.0.1:8000/v1 --request-rate 4 --dataset sharegpt:F
llmserve bench serve --target inprocess --dtype bfloat16 --input-len 128 --output-len 64
llmserve bench serve --request-rate 1,2,4,inf --concurrency 32 --plot-out curve.png
llmserve bench serve --concurrency 1,8,32,64 --json-out sweep.json
llmserve bench serve --sweep --concurrency 64   # saturate, then 25/50/75/90% of that rate
llmserve bench serve --compare-inprocess --concurrency 1,8   # the stack vs the in-process engine
llmserve bench serve --target grpc=grpc://127.0.0.1:50051 --target http=http://127.0.0.1:8000/v1 \
    --concurrency 16 --num-prompts 32 --input-len 128 --output-len 128 --ignore-eos
llmserve bench serve --target https://door.example:8443/v1 --target grpcs://door.example:50052 \
    --api-key "$KEY" --tls-ca ca.pem --rounds 3   # keys and TLS; medians over 3 rounds

Targets: `grpc://host:port` is our public API (TextGeneration.Generate), `grpcs://host:port`
the same over TLS; `http(s)://host:port/v1` is any OpenAI-compatible server (streaming
/v1/completions over httpx, SSE parsed in serve_clients.py); `inprocess` is an LLMEngine in
this process, stepped here. All record the same thing: send time, arrival time and token count
of each streamed chunk, end time. Load is either a fixed number of requests in flight
(--concurrency) or Poisson arrivals (--request-rate), or both (arrivals capped by the
concurrency). Comma lists of rates or concurrencies run a sweep, one point per load, each with
fresh prompts; --plot-out draws TTFT and TPOT against achieved throughput across the points
(serve_plot.py).

Several --target ([LABEL=]URL, the label names the target in the tables): every load point
runs on each target in turn, in the order given, with the same prompts and arrival times, and
one table ends the run, a row per (load point, target) with its ratios to the first target
(serve_compare.py); --rounds N repeats each point N times, every target in each round, with
fresh prompts per round, and the table holds medians over the rounds. Two targets in front of
one engine (our gRPC and HTTP doors) share its prefix cache: the second would be served the
first's prompts from the cache (the table's "prompt cached %" shows it), so measure such a
stack started with `llmserve up --no-enable-prefix-caching`.
--api-key KEY (else $LLMSERVE_API_KEY, else $OPENAI_API_KEY) goes to every remote target as
`Authorization: Bearer KEY`, an HTTP header or gRPC metadata, and is never printed;
--tls-ca FILE is the CA bundle https:// and grpcs:// trust (default: the system's store).
--compare-inprocess runs every point on the `llmserve up` stack, then on an in-process engine
with the same settings, and prints one table of both with the stack's ratios to the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import format_table, load_average, masked_argv
from benchmarks.process_cpu import ProcessCpu
from benchmarks.serve_clients import Access
from benchmarks.serve_compare import (
    INPROCESS,
    STACK,
    SystemRow,
    compare_document,
    compare_table,
    system_rows,
)
from benchmarks.serve_flags import add_serve_flags
from benchmarks.serve_load import Generation, Target
from benchmarks.serve_metrics import Slo
from benchmarks.serve_plot import (
    PlotUnavailableError,
    plot_latency_vs_throughput,
    require_matplotlib,
)
from benchmarks.serve_points import (
    WARMUP_SEED_OFFSET,
    LoadPlan,
    SystemRun,
    all_completed,
    build_samples,
    config_document,
    header,
    planned_points,
    plot_title,
    run_points,
    run_targets,
    with_access,
    write_json,
)
from benchmarks.serve_stack import (
    StackStartError,
    check_compare_flags,
    compare_stack_flags,
    compared_stack,
    compared_target,
)
from benchmarks.serve_targets import (
    check_target_flags,
    engine_config,
    grpc_target,
    inprocess_target,
    make_targets,
    target_access,
    target_specs,
)
from benchmarks.sweep import (
    SATURATION_FRACTIONS,
    SWEEP_HEADERS,
    CurvePoint,
    SweepPoint,
    curve_points,
    in_load_order,
    sweep_rows,
)

if TYPE_CHECKING:
    from services.engine.config import EngineConfig


def run(args: argparse.Namespace) -> int:
    try:
        if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        check_compare_flags(args)
        specs = target_specs(args)
        check_target_flags(args, specs)
        access, access_line = target_access(args, os.environ)
        points = planned_points(args)
        if args.plot_out:
            require_matplotlib()
        generation = Generation(args.temperature, args.ignore_eos, args.timeout_s)
        plan = LoadPlan(
            args,
            Slo(args.slo_ttft_ms, args.slo_tpot_ms),
            build_samples(args, args.num_prompts, args.seed),
            build_samples(args, args.warmup, args.seed + WARMUP_SEED_OFFSET),
            len(points) + (len(SATURATION_FRACTIONS) if args.sweep else 0),
            keep_samples=args.compare_inprocess or len(specs) > 1,
        )
        if args.compare_inprocess:
            # Checked now: a bad engine flag fails here, not after the stack's whole run.
            config = engine_config(args)
        else:
            targets = make_targets(args, generation, specs, access)
    except (ValueError, OSError, PlotUnavailableError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    if args.compare_inprocess:
        return run_compare(args, plan, points, generation, config, access, access_line)
    if len(targets) > 1:
        return run_several(args, plan, points, generation, targets, access_line)
    (target,) = targets.values()
    load_at_start = load_average()
    target_line = with_access(f"target: {target.description}", access_line)
    print(header(args, plan, generation, target_line, load_at_start) + "\n", flush=True)
    try:
        measured = run_points(target, plan, points, args.sweep)
    finally:
        target.close()
    ordered = in_load_order(measured.results)
    if len(ordered) > 1:
        print(format_table(SWEEP_HEADERS, sweep_rows(ordered)) + "\n(latencies in ms)")
    if args.json_out:
        document = {
            "command": masked_argv(sys.argv),
            "target": target.description,
            "load_average_at_start": load_at_start,
            "config": config_document(args),
            "points": measured.documents,
        }
        write_json(args.json_out, document)
    if args.plot_out:
        title = plot_title(args, plan, target.description)
        plot_latency_vs_throughput(curve_points(ordered), Path(args.plot_out), title)
        print(f"plot: {args.plot_out}")
    return 0 if all_completed([measured]) else 1


def row_curve_points(rows: Sequence[SystemRow]) -> list[CurvePoint]:
    """One curve per system, through its load points (the figures of the table's rows)."""
    return [
        CurvePoint(
            series=row.system,
            label=row.point.label,
            output_tokens_per_s=row.figures.output_tokens_per_s,
            ttft_p50_ms=row.figures.ttft_p50_ms,
            ttft_p99_ms=row.figures.ttft_p99_ms,
            tpot_p50_ms=row.figures.tpot_p50_ms,
            tpot_p99_ms=row.figures.tpot_p99_ms,
        )
        for row in rows
    ]


def run_several(
    args: argparse.Namespace,
    plan: LoadPlan,
    points: Sequence[SweepPoint],
    generation: Generation,
    targets: Mapping[str, Target],
    access_line: str | None,
) -> int:
    """Every load point on each target in turn (run_targets); one table of all, with every
    target's ratios to the first."""
    load_at_start = load_average()
    reference = next(iter(targets))
    descriptions = {label: target.description for label, target in targets.items()}
    rounds = f", {args.rounds} rounds" if args.rounds > 1 else ""
    target_lines = [
        f"targets: one after the other at every load point, the same prompts{rounds}; "
        f"ratios to {reference}",
        *(
            f"  {label}: {description}" if label != description else f"  {label}"
            for label, description in descriptions.items()
        ),
    ]
    target_line = with_access("\n".join(target_lines), access_line)
    print(header(args, plan, generation, target_line, load_at_start) + "\n", flush=True)
    try:
        measured = run_targets(targets, plan, points, args.sweep, args.rounds)
    finally:
        for target in targets.values():
            target.close()
    rows = system_rows({label: run.results for label, run in measured.items()}, reference)
    table = compare_table(rows, reference, args.rounds)
    print(f"## {' vs '.join(targets)}\n\n{table}", flush=True)
    if args.json_out:
        document = {
            "command": masked_argv(sys.argv),
            "target": " vs ".join(descriptions.values()),
            "load_average_at_start": load_at_start,
            "config": config_document(args),
            "points": [point for run in measured.values() for point in run.documents],
            "compare": compare_document(rows, descriptions, reference, None, args.rounds),
        }
        write_json(args.json_out, document)
    if args.plot_out:
        title = plot_title(args, plan, " vs ".join(targets))
        plot_latency_vs_throughput(row_curve_points(rows), Path(args.plot_out), title)
        print(f"plot: {args.plot_out}")
    return 0 if all_completed(list(measured.values())) else 1


def run_compare(
    args: argparse.Namespace,
    plan: LoadPlan,
    points: Sequence[SweepPoint],
    generation: Generation,
    config: EngineConfig,
    access: Access | None = None,
    access_line: str | None = None,
) -> int:
    """Every load point on the stack, then on the in-process engine; one table of both, the
    in-process engine the reference of the ratios.

    The stack runs first and is stopped before the engine loads: a stopped process hands every
    thread and byte back to the OS, while `del engine; gc.collect()` here would not (torch
    keeps its allocator caches and thread pools), so the other order would leave part of the
    first system around while the second is measured. A stack given by --target stays up but
    idle while the engine runs.
    """
    load_at_start = load_average()
    running = compared_target(args)
    started = running is None
    stack_command = ["llmserve", "up", *compare_stack_flags(args)] if started else None
    where = "started here, stopped before the engine loads" if started else running
    target_line = with_access(
        f"compare: the `llmserve up` stack ({where}), then the in-process engine, "
        "the same samples and warm-up, one system loaded at a time",
        access_line,
    )
    print(header(args, plan, generation, target_line, load_at_start) + "\n", flush=True)
    systems: dict[str, SystemRun] = {}
    targets: dict[str, str] = {}
    try:
        with compared_stack(args) as (url, processes):
            target = grpc_target(args, url, generation, access)
            targets[STACK] = target.description
            print(f"# {STACK}: {target.description}\n", flush=True)
            systems[STACK] = run_points(target, plan, points, args.sweep, STACK, processes)
    except StackStartError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 1
    # The points the stack ran, so under --sweep the engine meets the rates the stack's
    # saturated run gave.
    stack_points = [result.point for result in systems[STACK].results]
    target = inprocess_target(config, generation)
    targets[INPROCESS] = target.description
    print(f"# {INPROCESS}: {target.description}\n", flush=True)
    try:
        # One process: the engine and the load generator together.
        systems[INPROCESS] = run_points(
            target, plan, stack_points, False, INPROCESS, ProcessCpu({})
        )
    finally:
        target.close()
    for name, measured in systems.items():
        ordered = in_load_order(measured.results)
        if len(ordered) > 1:
            table = format_table(SWEEP_HEADERS, sweep_rows(ordered))
            print(f"{name}:\n{table}\n(latencies in ms)\n")
    results = {name: systems[name].results for name in (INPROCESS, STACK)}
    rows = system_rows(results, INPROCESS)
    print(f"## in-process vs stack\n\n{compare_table(rows, INPROCESS)}", flush=True)
    if args.json_out:
        document = {
            "command": masked_argv(sys.argv),
            "target": " vs ".join(targets.values()),
            "load_average_at_start": load_at_start,
            "config": config_document(args),
            "points": [
                {**point, "system": name}
                for name, measured in systems.items()
                for point in measured.documents
            ],
            "compare": compare_document(rows, targets, INPROCESS, stack_command),
        }
        write_json(args.json_out, document)
    if args.plot_out:
        curves = [
            replace(point, series=f"{name} {point.series}".strip())
            for name, measured in systems.items()
            for point in curve_points(in_load_order(measured.results))
        ]
        title = plot_title(args, plan, "stack vs in-process")
        plot_latency_vs_throughput(curves, Path(args.plot_out), title)
        print(f"plot: {args.plot_out}")
    return 0 if all_completed(list(systems.values())) else 1


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """`bench serve`'s flags (serve_flags.py), run by run()."""
    add_serve_flags(parser)
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serving load generator: TTFT/TPOT/ITL/E2E, throughput, goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
