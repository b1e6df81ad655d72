"""Serving benchmark: a load generator that streams requests to a target and reports TTFT,
TPOT, ITL, end-to-end latency, throughput and goodput (see serve_metrics.py).

llmserve bench serve --target grpc://127.0.0.1:50051 --num-prompts 64 --concurrency 8
llmserve bench serve --target http://127.0.0.1:8000/v1 --request-rate 4 --dataset sharegpt:F
llmserve bench serve --target inprocess --dtype bfloat16 --input-len 128 --output-len 64
llmserve bench serve --request-rate 1,2,4,inf --concurrency 32 --plot-out curve.png
llmserve bench serve --concurrency 1,8,32,64 --json-out sweep.json
llmserve bench serve --sweep --concurrency 64   # saturate, then 25/50/75/90% of that rate
llmserve bench serve --compare-inprocess --concurrency 1,8   # the stack vs the in-process engine

Targets: `grpc://host:port` is our public API (TextGeneration.Generate);
`http://host:port/v1` is any OpenAI-compatible server (streaming /v1/completions over httpx,
SSE parsed in serve_clients.py); `inprocess` is an LLMEngine in this process, stepped here. All
three record the same thing: send time, arrival time and token count of each streamed chunk,
end time. Load is either a fixed number of requests in flight (--concurrency) or Poisson
arrivals (--request-rate), or both (arrivals capped by the concurrency). Comma lists of rates
or concurrencies run a sweep, one point per load, each with fresh prompts; --plot-out draws
TTFT and TPOT against achieved throughput across the points (serve_plot.py).
--compare-inprocess runs every point on the `llmserve up` stack, then on an in-process engine
with the same settings, and prints one table of both with their ratios (serve_compare.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from services.bench.common import command_line, cpu_model_name, format_table, load_average
from services.bench.process_cpu import ProcessCpu, cpu_rows, cpu_table
from services.bench.serve_clients import GrpcClient, InProcessTarget, OpenAIClient
from services.bench.serve_compare import (
    INPROCESS,
    STACK,
    compare_document,
    compare_rows,
    compare_table,
    stack_up_flags,
)
from services.bench.serve_load import (
    AsyncTarget,
    Generation,
    Load,
    Target,
    report,
    run_point,
    warm_up,
)
from services.bench.serve_metrics import RequestRecord, Slo
from services.bench.serve_plot import (
    PlotUnavailableError,
    plot_latency_vs_throughput,
    require_matplotlib,
)
from services.bench.serve_workload import (
    LENGTH_DISTRIBUTIONS,
    Sample,
    lengths_file,
    shared_prefix,
    sharegpt,
    synthetic_lengths,
    synthetic_of_lengths,
    synthetic_text,
)
from services.bench.sweep import (
    SATURATION_FRACTIONS,
    SWEEP_HEADERS,
    PointResult,
    SweepPoint,
    curve_points,
    in_load_order,
    parse_concurrencies,
    parse_rates,
    point_seed,
    saturation_rates,
    sweep_points,
    sweep_rows,
)

if TYPE_CHECKING:
    from services.engine.config import EngineConfig

MAX_DEFAULT_CHANNELS = 8
WARMUP_SEED_OFFSET = 7919  # warm-up prompts differ from the timed ones: no prefix-cache hits
DEFAULT_TARGET = "grpc://127.0.0.1:50051"
ENGINE_SEED = 0
"""The in-process engine's sampler seed; a stack started for --compare-inprocess gets it too."""
STACK_LOG_TAIL_LINES = 30


def build_samples(args: argparse.Namespace, num_prompts: int, seed: int) -> list[Sample]:
    dataset: str = args.dataset
    if dataset == "synthetic":
        return synthetic_of_lengths(workload_lengths(args, num_prompts, seed), seed)
    if dataset == "synthetic-text":
        tokenizer = _tokenizer(args)
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
        tokenizer = _tokenizer(args)
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


_TOKENIZERS: dict[str | None, Any] = {}


def _tokenizer(args: argparse.Namespace) -> Any:
    """The --tokenizer model's tokenizer, loaded once (every sweep point builds prompts)."""
    if args.tokenizer not in _TOKENIZERS:
        from services.common.model_source import resolve_model_path
        from services.common.model_tokenizer import ModelTokenizer

        _TOKENIZERS[args.tokenizer] = ModelTokenizer.from_path(resolve_model_path(args.tokenizer))
    return _TOKENIZERS[args.tokenizer]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The in-process engine's config; building it checks the flags (quantization, KV dtype)."""
    from services.engine.config import EngineConfig
    from services.worker.config import GiB

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_bytes=int(args.kv_cache_gib * GiB),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.threads,
        enforce_eager=args.enforce_eager,
        seed=ENGINE_SEED,
    )
    # Without --quantization the engine's own default applies.
    if args.quantization is not None:
        config = replace(config, quantization=args.quantization)
    return config


def inprocess_target(config: EngineConfig, generation: Generation) -> Target:
    """Loads the model (and compiles its step graphs): the slow part of a run's start."""
    from services.engine.engine import LLMEngine

    return InProcessTarget(LLMEngine(config), generation)


def grpc_target(args: argparse.Namespace, target: str, generation: Generation) -> Target:
    address = target.removeprefix("grpc://")
    most_in_flight = max(args.concurrency) if args.concurrency else args.num_prompts
    channels = args.channels or min(most_in_flight, MAX_DEFAULT_CHANNELS)
    return AsyncTarget(
        f"{target} ({channels} channels)",
        lambda: GrpcClient(address, channels, generation),
    )


def make_target(args: argparse.Namespace, generation: Generation, target: str) -> Target:
    if target == "inprocess":
        return inprocess_target(engine_config(args), generation)
    if target.startswith("grpc://"):
        return grpc_target(args, target, generation)
    if target.startswith(("http://", "https://")):
        OpenAIClient(target, args.model, generation)  # validate the URL now
        return AsyncTarget(target, lambda: OpenAIClient(target, args.model, generation))
    raise ValueError(f"--target is grpc://host:port, http://host:port/v1 or inprocess: {target}")


# ---- --compare-inprocess: the same load on the stack, then on the in-process engine ------------


class StackStartError(RuntimeError):
    """The `llmserve up` stack to compare with did not come up."""


def check_compare_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag that does not fit the run asked for."""
    if not args.compare_inprocess:
        if args.stack_arg:
            raise ValueError("--stack-arg applies to the stack --compare-inprocess starts")
        return
    target: str | None = args.target
    if target is not None and not target.startswith("grpc://"):
        raise ValueError(
            "--compare-inprocess compares the in-process engine with the stack: --target is "
            f"grpc://host:port (a running stack) or absent (one is started); got {target!r}"
        )
    if target is not None and args.stack_arg:
        raise ValueError("--stack-arg applies to a stack started here, not to --target's")
    if args.tokenizer_replicas < 1:
        raise ValueError("--tokenizer-replicas must be >= 1")


def compare_stack_flags(args: argparse.Namespace) -> list[str]:
    """`llmserve up` flags giving the stack the in-process engine's settings (engine_config),
    its sampler seed included, then --tokenizer-replicas and every --stack-arg."""
    return stack_up_flags(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        seed=ENGINE_SEED,
        tokenizer_replicas=args.tokenizer_replicas,
        extra=args.stack_arg or [],
    )


def log_tail(log: IO[bytes], num_lines: int = STACK_LOG_TAIL_LINES) -> str:
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-num_lines:])


@contextlib.contextmanager
def compared_stack(args: argparse.Namespace) -> Iterator[tuple[str, ProcessCpu | None]]:
    """The stack's grpc:// URL: --target's, or that of an `llmserve up` started here on free
    ports and stopped (SIGTERM, a bounded wait, then SIGKILL) when the block ends; with the
    latter, its processes (by pid) for the CPU-by-process table."""
    if args.target is not None:
        yield args.target, None
        return
    from services.launcher import StackConfig
    from services.stack import running_stack

    flags = compare_stack_flags(args)
    # As long as `llmserve up` itself waits: a worker's first start builds the C++ kernels and
    # compiles its step graphs, minutes on 2 cores.
    startup_timeout_s = StackConfig().startup_timeout_s
    print(f"$ llmserve up {shlex.join(flags)}", flush=True)
    # The stack's processes log JSON lines on stderr: they go to an unnamed file, kept out of
    # the report, and its tail is shown when the stack fails to start or to stop cleanly.
    with tempfile.TemporaryFile() as log, contextlib.ExitStack() as running:
        try:
            stack = running.enter_context(
                running_stack(flags, startup_timeout_s=startup_timeout_s, stderr=log)
            )
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise StackStartError(f"llmserve up did not start: {exc}\n{log_tail(log)}") from exc
        try:
            yield f"grpc://{stack.public}", ProcessCpu(stack.info["pids"])
        finally:
            # Stopped before the engine loads, and timed: a slow drain delays the next system.
            stopping = time.perf_counter()
            running.close()
            print(
                f"llmserve up stopped: exit {stack.returncode} after "
                f"{time.perf_counter() - stopping:.1f} s\n",
                flush=True,
            )
            if stack.returncode != 0:
                print(log_tail(log), file=sys.stderr)


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
    """Keep each point's prompts once drawn, for a second target to get the very same ones
    (--compare-inprocess); else a point's prompts are dropped after it, as a sweep's add up."""
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
    args = plan.args
    pending = list(points)
    measured = SystemRun()
    prefix = f"{name} " if name else ""
    while pending:
        point = pending.pop(0)
        index = len(measured.results)
        seed = point_seed(args.seed, index)
        samples = plan.samples(index)
        load = Load(point.request_rate, point.concurrency, args.seed)
        description = f"{prefix}load {index + 1}/{plan.num_points}"
        print(f"## {description}: {load.describe()}", flush=True)
        # Warmed up first, so the CPU snapshots cover the measured requests only.
        warm_up(target, plan.warmup if index == 0 else (), load.concurrency)
        before = processes.snapshot() if processes is not None else None
        summary, records = run_point(target, samples, load, plan.slo, description=description)
        print(report(summary) + "\n", flush=True)
        if processes is not None and before is not None:
            rows = cpu_rows(before, processes.snapshot(), summary.output_tokens)
            print(f"CPU by process:\n{cpu_table(rows)}\n", flush=True)
        result = PointResult(point, len(samples), summary)
        measured.results.append(result)
        measured.documents.append(point_document(result, seed, records))
        if sweep and index == 0:
            try:
                rates = saturation_rates(summary.requests_per_s)
            except ValueError as exc:
                print(f"bench serve: --sweep stops: {exc}", file=sys.stderr)
                break
            pending = [SweepPoint(rate, point.concurrency) for rate in rates]
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


def run(args: argparse.Namespace) -> int:
    try:
        if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        check_compare_flags(args)
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
            keep_samples=args.compare_inprocess,
        )
        if args.compare_inprocess:
            # Checked now: a bad engine flag fails here, not after the stack's whole run.
            config = engine_config(args)
        else:
            target = make_target(args, generation, args.target or DEFAULT_TARGET)
    except (ValueError, OSError, PlotUnavailableError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    if args.compare_inprocess:
        return run_compare(args, plan, points, generation, config)
    load_at_start = load_average()
    target_line = f"target: {target.description}"
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
            "command": sys.argv,
            "target": target.description,
            "load_average_at_start": load_at_start,
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "points": measured.documents,
        }
        write_json(args.json_out, document)
    if args.plot_out:
        title = plot_title(args, plan, target.description)
        plot_latency_vs_throughput(curve_points(ordered), Path(args.plot_out), title)
        print(f"plot: {args.plot_out}")
    return 0 if all_completed([measured]) else 1


def run_compare(
    args: argparse.Namespace,
    plan: LoadPlan,
    points: Sequence[SweepPoint],
    generation: Generation,
    config: EngineConfig,
) -> int:
    """Every load point on the stack, then on the in-process engine; one table of both.

    The stack runs first and is stopped before the engine loads: a stopped process hands every
    thread and byte back to the OS, while `del engine; gc.collect()` here would not (torch
    keeps its allocator caches and thread pools), so the other order would leave part of the
    first system around while the second is measured. A stack given by --target stays up but
    idle while the engine runs.
    """
    load_at_start = load_average()
    started = args.target is None
    stack_command = ["llmserve", "up", *compare_stack_flags(args)] if started else None
    where = "started here, stopped before the engine loads" if started else args.target
    target_line = (
        f"compare: the `llmserve up` stack ({where}), then the in-process engine, "
        "the same samples and warm-up, one system loaded at a time"
    )
    print(header(args, plan, generation, target_line, load_at_start) + "\n", flush=True)
    systems: dict[str, SystemRun] = {}
    targets: dict[str, str] = {}
    try:
        with compared_stack(args) as (url, processes):
            target = grpc_target(args, url, generation)
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
    rows = compare_rows(systems[INPROCESS].results, systems[STACK].results)
    print(f"## in-process vs stack\n\n{compare_table(rows)}", flush=True)
    if args.json_out:
        document = {
            "command": sys.argv,
            "target": " vs ".join(targets.values()),
            "load_average_at_start": load_at_start,
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "points": [
                {**point, "system": name}
                for name, measured in systems.items()
                for point in measured.documents
            ],
            "compare": compare_document(rows, targets, stack_command),
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


def _rates_argument(text: str) -> list[float]:
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _concurrencies_argument(text: str) -> list[int]:
    try:
        return parse_concurrencies(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        help="grpc://host:port (our API), http://host:port/v1 (OpenAI-compatible) or inprocess "
        f"(default: {DEFAULT_TARGET}; with --compare-inprocess: a stack started here)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=_concurrencies_argument,
        default=None,
        help="most requests in flight (default: no cap); a list like 1,8,32,64 sweeps it",
    )
    load.add_argument(
        "--request-rate",
        type=_rates_argument,
        default=[math.inf],
        help="Poisson arrivals, requests/s (default inf: all at once); a list like 1,2,4,inf "
        "sweeps it (with a concurrency list: every pair)",
    )
    load.add_argument(
        "--sweep",
        action="store_true",
        help="run all at once to find the saturated rate, then Poisson at "
        + "/".join(f"{int(100 * f)}" for f in SATURATION_FRACTIONS)
        + "%% of it",
    )
    load.add_argument("--warmup", type=int, default=0, help="untimed requests before the run")
    load.add_argument(
        "--channels",
        type=int,
        default=None,
        help="gRPC channels, one connection each (default: min(concurrency, 8))",
    )
    load.add_argument("--timeout-s", type=float, default=None, help="per-request deadline")
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (token ids) | synthetic-text (the same, sent as text re-encoded to "
        "--input-len tokens, for servers without token-id prompts) | shared-prefix | "
        "sharegpt:FILE (ShareGPT JSON)",
    )
    workload.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (shared-prefix: the per-user suffix after the prefix)",
    )
    workload.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    workload.add_argument(
        "--length-dist",
        default="fixed",
        choices=LENGTH_DISTRIBUTIONS,
        help="synthetic: prompt and output lengths exactly --input-len/--output-len (fixed), "
        "uniform in mean*(1 +- spread), or normal with sd = spread*mean",
    )
    workload.add_argument(
        "--length-spread", type=float, default=0.25, help="synthetic uniform/normal spread"
    )
    workload.add_argument(
        "--lengths-file",
        default=None,
        help="synthetic: (input_len, output_len) pairs, CSV lines or a JSON list, cycled",
    )
    workload.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix only")
    workload.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts"
    )
    workload.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: fixed output length instead of each reply's",
    )
    workload.add_argument(
        "--tokenizer",
        default=None,
        help="sharegpt, synthetic-text: model whose tokenizer counts lengths (default: embedded)",
    )
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default on)",
    )
    workload.add_argument("--temperature", type=float, default=0.0)
    slo = parser.add_argument_group("goodput")
    slo.add_argument("--slo-ttft-ms", type=float, default=None)
    slo.add_argument("--slo-tpot-ms", type=float, default=None)
    engine = parser.add_argument_group(
        "inprocess target (and the stack --compare-inprocess starts)"
    )
    engine.add_argument(
        "--model",
        default=None,
        help="inprocess: GGUF file or HF directory; http: model name (default: first listed)",
    )
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument("--max-num-batched-tokens", type=int, default=1024)
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--kv-cache-gib", type=float, default=1.0)
    engine.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    engine.add_argument(
        "--quantization",
        default=None,
        help="weight format, as `llmserve up --quantization` (default: the engine's)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly, without compiled step graphs",
    )
    compare = parser.add_argument_group("in-process vs stack")
    compare.add_argument(
        "--compare-inprocess",
        action="store_true",
        help="run every load point on the `llmserve up` stack (--target grpc://host:port, or "
        "one started here with the inprocess target's flags), then on the in-process engine, "
        "and print both side by side with their ratios",
    )
    compare.add_argument(
        "--tokenizer-replicas",
        type=int,
        default=1,
        help="--compare-inprocess: tokenizer processes of the stack started here",
    )
    compare.add_argument(
        "--stack-arg",
        action="append",
        default=None,
        metavar="FLAG",
        help="--compare-inprocess: appended to the `llmserve up` command of the stack started "
        "here; repeatable, written with '=' (--stack-arg=--no-redis)",
    )
    parser.add_argument(
        "--json-out", default=None, help="also write every point's summary and requests"
    )
    parser.add_argument(
        "--plot-out",
        default=None,
        help="PNG: TTFT and TPOT p50/p99 vs achieved throughput across the points "
        "(needs matplotlib: pip install 'llmserve[bench]')",
    )
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
