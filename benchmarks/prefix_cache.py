"""`llmserve bench prefix-cache`: what the prefix cache and cache-aware routing buy.

The workload the seeds describe for system-prompt caching: `--users` users share system
prompts of `--prefix-len` tokens (`--num-prefixes` distinct ones) and each sends
`--questions` short questions. The same seeded workload runs against fresh stacks of
`--workers` scheduler+worker pairs (`llmserve up`), one per mode:

  cache_aware  prefix cache on; tokenizers route to the scheduler holding the longest prefix
  round_robin  prefix cache on; tokenizers route in turn
  no_cache     prefix cache off (every prompt token is computed)

and prints TTFT p50/p99 and the prompt tokens actually computed (prompt − cached, from each
response's usage), side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import random_prompts
from benchmarks.serve_clients import GrpcClient
from benchmarks.serve_load import AsyncTarget, Generation
from benchmarks.serve_metrics import RequestRecord, summarize
from benchmarks.serve_workload import Sample, shared_prefix
from services.stack import running_stack

MODES = {
    "cache_aware": ["--routing", "cache_aware"],
    "round_robin": ["--routing", "round_robin"],
    "no_cache": ["--routing", "round_robin", "--no-enable-prefix-caching"],
}


@dataclass(frozen=True, slots=True)
class ModeResult:
    mode: str
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    prompt_tokens: int
    computed_prompt_tokens: int
    output_tokens_per_s: float
    errors: int


def result_of(mode: str, records: Sequence[RequestRecord]) -> ModeResult:
    summary = summarize(records)
    completed = [r for r in records if r.ok]
    return ModeResult(
        mode=mode,
        ttft_p50_ms=summary.ttft.p50_ms,
        ttft_p99_ms=summary.ttft.p99_ms,
        e2e_p50_ms=summary.e2e.p50_ms,
        prompt_tokens=sum(r.prompt_tokens for r in completed),
        computed_prompt_tokens=sum(r.prompt_tokens - r.cached_prompt_tokens for r in completed),
        output_tokens_per_s=summary.output_tokens_per_s,
        errors=summary.num_requests - summary.num_completed,
    )


def table(results: Sequence[ModeResult]) -> str:
    baseline = next((r for r in results if r.mode == "no_cache"), None)
    lines = [
        "| mode | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | prompt tokens | computed | "
        "output tok/s | TTFT p50 vs no cache | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        speedup = (
            baseline.ttft_p50_ms / r.ttft_p50_ms
            if baseline is not None and r.ttft_p50_ms > 0
            else math.nan
        )
        lines.append(
            f"| {r.mode} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.e2e_p50_ms:.0f} | "
            f"{r.prompt_tokens} | {r.computed_prompt_tokens} | {r.output_tokens_per_s:.1f} | "
            f"{speedup:.2f}x | {r.errors} |"
        )
    return "\n".join(lines)


def workload(args: argparse.Namespace) -> list[Sample]:
    """Question q of every user comes before question q + 1 of anyone: turns interleave."""
    num = args.users * args.questions
    samples = shared_prefix(
        num, args.prefix_len, args.question_len, args.output_len, args.seed, args.num_prefixes
    )
    return [
        samples[u * args.questions + q] for q in range(args.questions) for u in range(args.users)
    ]


def run_mode(mode: str, args: argparse.Namespace, samples: Sequence[Sample]) -> ModeResult:
    flags = ["--workers", str(args.workers), "--tokenizer-replicas", str(args.tokenizer_replicas)]
    flags += ["--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib), *MODES[mode]]
    print(f"{mode}: starting llmserve up {' '.join(flags)}", flush=True)
    generation = Generation(temperature=0.0, ignore_eos=True, timeout_s=600)
    with running_stack(flags, stderr=subprocess.DEVNULL) as stack:
        target = AsyncTarget(mode, lambda: GrpcClient(stack.public, args.users, generation))
        # Warm every worker (first-step allocations, kernels) on prompts unrelated to the test.
        warm = [Sample(tuple(p), 4) for p in random_prompts(2 * args.workers, 24, seed=999)]
        target.run(warm, [0.0] * len(warm), None, None)
        with tqdm(total=len(samples), desc=mode, unit="req") as progress:
            records = target.run(samples, [0.0] * len(samples), args.users, progress)
    return result_of(mode, records)


def run(args: argparse.Namespace) -> int:
    samples = workload(args)
    results = [run_mode(mode, args, samples) for mode in args.modes]
    print()
    print(
        f"{args.users} users x {args.questions} questions; {args.num_prefixes} shared prefix(es) "
        f"of {args.prefix_len} tokens + {args.question_len}-token questions, "
        f"{args.output_len} output tokens; {args.workers} scheduler+worker pairs"
    )
    print(table(results))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "func"},
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0 if all(r.errors == 0 for r in results) else 1


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "prefix-cache",
        help="TTFT and prefill work with cache-aware routing vs round-robin vs no prefix cache",
    )
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--questions", type=int, default=2, help="questions per user")
    parser.add_argument("--prefix-len", type=int, default=1000, help="system prompt tokens")
    parser.add_argument("--num-prefixes", type=int, default=1, help="distinct system prompts")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokenizer-replicas", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    parser.set_defaults(func=run)
