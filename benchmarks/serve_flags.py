"""The flags of `llmserve bench serve` (serve.py): targets and access, the workload, the load
and its sweeps, the engine settings of in-process targets, and the outputs."""

from __future__ import annotations

import argparse
import math

from benchmarks.serve_workload import LENGTH_DISTRIBUTIONS
from benchmarks.sweep import SATURATION_FRACTIONS, parse_concurrencies, parse_rates

DEFAULT_TARGET = "grpc://127.0.0.1:50051"
API_KEY_VARIABLES = ("LLMSERVE_API_KEY", "OPENAI_API_KEY")
"""Where the API key comes from without --api-key, the first one set."""


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


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        action="append",
        default=None,
        metavar="[LABEL=]URL",
        help="grpc://host:port (our API), grpcs://host:port (the same over TLS), "
        "http(s)://host:port/v1 (OpenAI-compatible) or inprocess, with an optional label for "
        "the tables (default: the URL). Repeatable: every load point runs on each target in "
        "turn, with the same prompts, and one table compares them, ratios to the first "
        f"(default: {DEFAULT_TARGET}; with --compare-inprocess: a stack started here)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="several --target: run each load point this many times, every target in turn in "
        "each round with fresh prompts; the table holds medians over the rounds",
    )
    access = parser.add_argument_group("access")
    access.add_argument(
        "--api-key",
        default=None,
        help="sent to every target as `Authorization: Bearer KEY` (HTTP header, gRPC "
        f"metadata); default: ${API_KEY_VARIABLES[0]}, else ${API_KEY_VARIABLES[1]}. "
        "Never printed",
    )
    access.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="PEM bundle of the CAs to trust for https:// and grpcs:// targets "
        "(default: the system's CA store)",
    )
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
    engine.add_argument(
        "--no-speculation",
        action="store_true",
        help="every draft proposer off (as `llmserve up --no-speculation`): one token per step",
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
