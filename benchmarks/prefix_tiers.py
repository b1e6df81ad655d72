"""`llmserve bench prefix-tiers`: what the KV tiers below the pool buy (docs/prefix-cache.md).

(a) `--conversations` conversations of `--turns` turns over `--history-tokens`-token
    histories (benchmarks/prefix_tiers_workload.py), sent turn-major to one `llmserve up`
    pair whose KV pool holds about `--pool-conversations` of them: the prompt tokens served
    from cache and the mean TTFT with the disk tier (`--kv-disk-dir`) against the same run
    with the pool alone.
(b) The stack of (a) stopped and started again on the same directory; each conversation's
    next turn: its cached share and mean TTFT against the same turns on a cold start (the
    same flags, an empty directory).
(c) Two pairs behind Redis, routed round robin: each conversation's first two turns back to
    back, so the second lands on the pair that did not compute the first. Its cached share
    and mean TTFT with prefix fetch (the blocks come from the other pair's pool) against the
    same run with fetching off (`--prefix-fetch-min-blocks 0`: it recomputes them).

Each run is a fresh stack, warmed on prompts unrelated to the workload; requests go one at a
time (`--concurrency`), so a TTFT is the request's own prefill, not a queue.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm  # type: ignore[import-untyped]

from benchmarks.common import machine_header, positive_float, positive_int, random_prompts
from benchmarks.prefix_tiers_workload import (
    RunSummary,
    Turn,
    conversations,
    cross_pair_turns,
    kv_bytes_per_token,
    pool_gib,
    ratios_table,
    resume_turns,
    runs_table,
    summarize,
    tier_ratios,
    turn_major,
)
from benchmarks.serve_clients import GrpcClient
from benchmarks.serve_load import AsyncTarget, Generation
from benchmarks.serve_metrics import RequestRecord
from benchmarks.serve_workload import Sample
from services.common.gguf_metadata import read_metadata
from services.common.model_source import resolve_model_path
from services.stack import running_stack

KV_DTYPE = "float16"
KV_DTYPE_BYTES = 2
BLOCK_SIZE = 16
QUICK = {
    "conversations": 4,
    "turns": 3,
    "history_tokens": 256,
    "turn_tokens": 32,
    "output_tokens": 4,
}


def stack_flags(args: argparse.Namespace, kv_cache_gib: float, max_model_len: int) -> list[str]:
    flags = [
        *("--workers", "1", "--no-redis"),
        *("--kv-cache-dtype", KV_DTYPE, "--kv-cache-gib", f"{kv_cache_gib:.6f}"),
        *("--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_model_len)),
    ]
    if args.model not in (None, "", "embedded"):
        flags += ["--model", args.model]
    return [*flags, *shlex.split(args.up_flags)]


def cross_pair_flags(args: argparse.Namespace, max_model_len: int, fetch: bool) -> list[str]:
    """Two pairs with Redis (a private redis-server), their pools large enough to keep every
    history: only the pair that computed a prefix holds it."""
    flags = [
        *("--workers", "2", "--routing", "round_robin"),
        *("--kv-cache-dtype", KV_DTYPE, "--block-size", str(BLOCK_SIZE)),
        *("--max-model-len", str(max_model_len)),
    ]
    if not fetch:
        flags += ["--prefix-fetch-min-blocks", "0"]
    if args.model not in (None, "", "embedded"):
        flags += ["--model", args.model]
    return [*flags, *shlex.split(args.up_flags)]


def run_stack(
    label: str, flags: list[str], turns: Sequence[Turn], args: argparse.Namespace
) -> RunSummary:
    return summarize(label, serve(label, flags, turns, args))


def run_cross_pair(
    label: str, flags: list[str], turns: Sequence[Turn], args: argparse.Namespace
) -> RunSummary:
    """Only the second of each conversation's two turns counts: the one on the other pair."""
    return summarize(label, serve(label, flags, turns, args)[1::2])


def serve(
    label: str, flags: list[str], turns: Sequence[Turn], args: argparse.Namespace
) -> list[RequestRecord]:
    print(f"{label}: llmserve up {' '.join(flags)}", flush=True)
    generation = Generation(temperature=0.0, ignore_eos=True, timeout_s=1800)
    samples = [Sample(t.prompt_token_ids, args.output_tokens) for t in turns]
    with running_stack(flags, stderr=subprocess.DEVNULL) as stack:
        target = AsyncTarget(label, lambda: GrpcClient(stack.public, args.concurrency, generation))
        # First-step allocations and kernels, on prompts no conversation shares.
        warm = [Sample(tuple(p), 2) for p in random_prompts(2, 24, seed=999_999)]
        target.run(warm, [0.0] * len(warm), 1, None)
        with tqdm(total=len(samples), desc=label, unit="req") as progress:
            return target.run(samples, [0.0] * len(samples), args.concurrency, progress)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    convs = conversations(
        args.conversations, args.turns, args.history_tokens, args.turn_tokens, args.seed
    )
    longest = len(convs[0][-1].prompt_token_ids) + args.output_tokens
    max_model_len = longest + BLOCK_SIZE
    kv_cache_gib = args.kv_cache_gib
    if kv_cache_gib is None:
        per_token = kv_bytes_per_token(
            read_metadata(resolve_model_path(args.model)), KV_DTYPE_BYTES
        )
        kv_cache_gib = pool_gib(per_token, longest, args.pool_conversations, BLOCK_SIZE)
    flags = stack_flags(args, kv_cache_gib, max_model_len)
    with tempfile.TemporaryDirectory(prefix="llmserve-prefix-tiers-") as work:
        disk, empty = Path(work) / "kv", Path(work) / "kv-cold"
        tiers_flags = [*flags, "--kv-disk-dir", str(disk), "--kv-disk-gib", str(args.kv_disk_gib)]
        cold_flags = [*flags, "--kv-disk-dir", str(empty), "--kv-disk-gib", str(args.kv_disk_gib)]
        sent = turn_major(convs, args.turns)
        resumed = resume_turns(convs)
        pool_only = run_stack("pool only", flags, sent, args)
        tiers = run_stack("tiers", tiers_flags, sent, args)
        restarted = run_stack("restarted", tiers_flags, resumed, args)
        cold = run_stack("cold start", cold_flags, resumed, args)
    # Round robin alternates from the first request, so each pair of turns splits in two.
    paired = cross_pair_turns(convs)
    fetched = run_cross_pair(
        "fetched (pair B)", cross_pair_flags(args, max_model_len, True), paired, args
    )
    recomputed = run_cross_pair(
        "recomputed (pair B)", cross_pair_flags(args, max_model_len, False), paired, args
    )
    runs = [pool_only, tiers, restarted, cold, fetched, recomputed]
    ratios = tier_ratios(tiers, pool_only, restarted, cold, fetched, recomputed)
    print()
    print(machine_header(torch_threads=os.cpu_count() or 1))
    print(
        f"model: {resolve_model_path(args.model)}; {args.conversations} conversations x "
        f"{args.turns} turns over {args.history_tokens}-token histories (+{args.turn_tokens} "
        f"tokens a turn), {args.output_tokens} output tokens, concurrency {args.concurrency}; "
        f"KV pool {kv_cache_gib:.3f} GiB ({KV_DTYPE}) ~ {args.pool_conversations:g} "
        f"conversations; one scheduler+worker pair, two for (c)"
    )
    print()
    print(runs_table(runs))
    print()
    print(ratios_table(ratios))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "func"},
                    "runs": [{**asdict(r), "hit_rate": r.hit_rate} for r in runs],
                    "ratios": [{**asdict(r), "met": r.met} for r in ratios],
                },
                indent=2,
            )
        )
    return 0 if all(r.errors == 0 for r in runs) else 1


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "prefix-tiers",
        help="hit rate and TTFT with the KV disk tier vs the pool alone, after a restart, and "
        "with a prefix fetched from another pair vs recomputed",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF file (e.g. ~/.cache/llmserve/shapes/llama-3.2-1b/*Q4_K_M*.gguf); "
        "default: the embedded model",
    )
    parser.add_argument("--conversations", type=positive_int, default=20)
    parser.add_argument("--turns", type=positive_int, default=10, help="turns per conversation")
    parser.add_argument("--history-tokens", type=positive_int, default=2000)
    parser.add_argument(
        "--turn-tokens", type=positive_int, default=64, help="tokens each turn adds"
    )
    parser.add_argument("--output-tokens", type=positive_int, default=16)
    parser.add_argument(
        "--pool-conversations",
        type=positive_float,
        default=3.0,
        help="conversations the KV pool holds (sets --kv-cache-gib from the model's shape)",
    )
    parser.add_argument(
        "--kv-cache-gib", type=positive_float, default=None, help="the pool's size instead (GiB)"
    )
    parser.add_argument("--kv-disk-gib", type=positive_float, default=10.0)
    parser.add_argument("--concurrency", type=positive_int, default=1)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 4 conversations x 3 turns over 256-token histories",
    )
    parser.add_argument(
        "--up-flags",
        default="",
        help="more `llmserve up` flags for every run, one string (e.g. '--enforce-eager')",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    parser.set_defaults(func=run)
