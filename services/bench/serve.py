"""Serving benchmark: a load generator that streams requests to a target and reports TTFT,
TPOT, ITL, end-to-end latency, throughput and goodput (see serve_metrics.py).

llmserve bench serve --target grpc://127.0.0.1:50051 --num-prompts 64 --concurrency 8
llmserve bench serve --target http://127.0.0.1:8000/v1 --request-rate 4 --dataset sharegpt:F
llmserve bench serve --target inprocess --dtype bfloat16 --input-len 128 --output-len 64
llmserve bench serve --request-rate 1,2,4,inf --concurrency 32 --plot-out curve.png
llmserve bench serve --concurrency 1,8,32,64 --json-out sweep.json
llmserve bench serve --sweep --concurrency 64   # saturate, then 25/50/75/90% of that rate

Targets: `grpc://host:port` is our public API (TextGeneration.Generate);
`http://host:port/v1` is any OpenAI-compatible server (streaming /v1/completions over httpx,
SSE parsed in serve_clients.py); `inprocess` is an LLMEngine in this process, stepped here. All
three record the same thing: send time, arrival time and token count of each streamed chunk,
end time. Load is either a fixed number of requests in flight (--concurrency) or Poisson
arrivals (--request-rate), or both (arrivals capped by the concurrency). Comma lists of rates
or concurrencies run a sweep, one point per load, each with fresh prompts; --plot-out draws
TTFT and TPOT against achieved throughput across the points (serve_plot.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from services.bench.common import command_line, cpu_model_name, format_table, load_average
from services.bench.serve_clients import GrpcClient, InProcessTarget, OpenAIClient
from services.bench.serve_load import AsyncTarget, Generation, Load, Target, report, run_point
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

MAX_DEFAULT_CHANNELS = 8
WARMUP_SEED_OFFSET = 7919  # warm-up prompts differ from the timed ones: no prefix-cache hits


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


def make_target(args: argparse.Namespace, generation: Generation) -> Target:
    target: str = args.target
    if target == "inprocess":
        from services.engine.config import EngineConfig
        from services.engine.engine import LLMEngine
        from services.worker.config import GiB

        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_bytes=int(args.kv_cache_gib * GiB),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            num_threads=args.threads,
            enforce_eager=args.enforce_eager,
            seed=0,
        )
        # Without --quantization the engine's own default applies.
        if args.quantization is not None:
            config = replace(config, quantization=args.quantization)
        engine = LLMEngine(config)
        return InProcessTarget(engine, generation)
    if target.startswith("grpc://"):
        address = target.removeprefix("grpc://")
        most_in_flight = max(args.concurrency) if args.concurrency else args.num_prompts
        channels = args.channels or min(most_in_flight, MAX_DEFAULT_CHANNELS)
        return AsyncTarget(
            f"{target} ({channels} channels)",
            lambda: GrpcClient(address, channels, generation),
        )
    if target.startswith(("http://", "https://")):
        OpenAIClient(target, args.model, generation)  # validate the URL now
        return AsyncTarget(target, lambda: OpenAIClient(target, args.model, generation))
    raise ValueError(f"--target is grpc://host:port, http://host:port/v1 or inprocess: {target}")


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


def run(args: argparse.Namespace) -> int:
    try:
        if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        pending = planned_points(args)
        if args.plot_out:
            require_matplotlib()
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
        generation = Generation(args.temperature, args.ignore_eos, args.timeout_s)
        first_samples = build_samples(args, args.num_prompts, args.seed)
        warmup = build_samples(args, args.warmup, args.seed + WARMUP_SEED_OFFSET)
        target = make_target(args, generation)
    except (ValueError, OSError, PlotUnavailableError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    load_at_start = load_average()
    mean_prompt = sum(s.prompt_len for s in first_samples) / len(first_samples)
    mean_output = sum(s.output_len for s in first_samples) / len(first_samples)
    num_points = len(pending) + (len(SATURATION_FRACTIONS) if args.sweep else 0)
    header = "\n".join(
        [
            f"command: `{command_line()}`",
            f"target: {target.description}",
            f"client cpu: {cpu_model_name()}; {load_at_start}",
            f"workload: {args.dataset}, {len(first_samples)} requests per load point "
            f"(+{args.warmup} warm-up), mean prompt {mean_prompt:.1f} tokens, mean output "
            f"{mean_output:.1f} tokens, ignore_eos {generation.ignore_eos}, "
            f"temperature {generation.temperature}",
            f"load points: {num_points}" + (" (--sweep: saturated first)" if args.sweep else ""),
        ]
    )
    print(header + "\n", flush=True)
    results: list[PointResult] = []
    documents: list[Any] = []
    try:
        while pending:
            point = pending.pop(0)
            index = len(results)
            seed = point_seed(args.seed, index)
            samples = first_samples if index == 0 else build_samples(args, args.num_prompts, seed)
            load = Load(point.request_rate, point.concurrency, args.seed)
            print(f"## load {index + 1}/{num_points}: {load.describe()}", flush=True)
            summary, records = run_point(
                target,
                samples,
                load,
                slo,
                warmup if index == 0 else (),
                description=f"load {index + 1}/{num_points}",
            )
            print(report(summary) + "\n", flush=True)
            result = PointResult(point, len(samples), summary)
            results.append(result)
            documents.append(point_document(result, seed, records))
            if args.sweep and index == 0:
                try:
                    rates = saturation_rates(summary.requests_per_s)
                except ValueError as exc:
                    print(f"bench serve: --sweep stops: {exc}", file=sys.stderr)
                    break
                pending = [SweepPoint(rate, point.concurrency) for rate in rates]
    finally:
        target.close()
    ordered = in_load_order(results)
    if len(results) > 1:
        print(format_table(SWEEP_HEADERS, sweep_rows(ordered)) + "\n(latencies in ms)")
    if args.json_out:
        document = {
            "command": sys.argv,
            "target": target.description,
            "load_average_at_start": load_at_start,
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "points": documents,
        }
        with open(args.json_out, "w", encoding="utf-8") as sink:
            json.dump(json_safe(document), sink, indent=1)
    if args.plot_out:
        title = f"{target.description}; {args.dataset} {mean_prompt:.0f}->{mean_output:.0f} tokens"
        plot_latency_vs_throughput(curve_points(ordered), Path(args.plot_out), title)
        print(f"plot: {args.plot_out}")
    return 0 if all(result.summary.num_completed for result in results) else 1


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
        default="grpc://127.0.0.1:50051",
        help="grpc://host:port (our API), http://host:port/v1 (OpenAI-compatible) or inprocess",
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
    engine = parser.add_argument_group("inprocess target")
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
