"""What verifying drafts costs on a given model: the worker's whole step (forward, sampling,
verification, bookkeeping) for one sequence computing 1, 2, 4, 8, 16 rows (its decode and
rows - 1 drafts), against a plain decode step.

    llmserve bench verify-rows --model FILE.gguf [--rows 1,2,4,8,16] [--context 256]

A step of R rows pays when its drafts yield more than `R-row ms / 1-row ms - 1` extra tokens
on average; the break-even acceptance is the chance a that gives a + a^2 + ... + a^(R-1)
that many (draft j is accepted only if drafts 1..j-1 were). The scheduler's policy measures
the same cost line as it serves (services/scheduler/features/speculation_policy.py); this
table shows it for a model file and machine, e.g. where the CPU kernels' row tile ends.

The drafts are fixed tokens handed to the worker's real step in place of its proposers' (so
every step has exactly R rows); they are mostly rejected, so the sequence grows by about one
token per step, as a decode does. Each figure is the median of --steps steps after two warm
ones; the CPU flags and the kernels' instruction set are printed above the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from time import perf_counter

import torch

from benchmarks.common import machine_header, parse_int_list, random_prompts
from services.common.tables import format_table
from services.contracts.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.runner import ModelRunner

REQUEST_ID = "verify"
WARM_STEPS = 2
HEADERS = [
    "rows",
    "drafts",
    "ms / step",
    "vs 1 row",
    "extra tokens to pay",
    "break-even acceptance",
]


def break_even_acceptance(num_drafts: int, extra_tokens: float) -> float | None:
    """The a in [0, 1] with a + a^2 + ... + a^num_drafts = extra_tokens (None: beyond 1)."""
    if num_drafts == 0 or extra_tokens > num_drafts:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        if sum(mid**j for j in range(1, num_drafts + 1)) < extra_tokens:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def step_times_ms(
    runner: ModelRunner, num_rows: int, steps: int, first_step_id: int
) -> list[float]:
    """Wall time of the worker's step for the sequence with num_rows - 1 drafts."""
    num_drafts = num_rows - 1
    sequence = runner.batch.sequences[REQUEST_ID]
    # The real step, with fixed drafts in place of the proposers' (which may find none).
    runner.batch.propose_drafts = lambda plan: (  # type: ignore[method-assign]
        {REQUEST_ID: [sequence.token_ids[-1]] * num_drafts},
        {REQUEST_ID: "ngram"},
    )
    times = []
    for index in range(WARM_STEPS + steps):
        plan = BatchPlan(
            first_step_id + index,
            num_scheduled_tokens={REQUEST_ID: 1},
            draft_slots={REQUEST_ID: num_drafts} if num_drafts else {},
        )
        started = perf_counter()
        runner.execute(plan)
        if index >= WARM_STEPS:
            times.append((perf_counter() - started) * 1e3)
    return times


def decode_path(runner: ModelRunner) -> str:
    if runner.fused_decode is not None:
        return "fused C++ decode"
    return "compiled graphs" if runner.decode_graphs is not None else "eager"


def kernel_isa() -> str:
    from kernels import cpu_extension

    if not cpu_extension.load():
        return "unavailable (no C++ kernels)"
    return str(torch.ops.llmserve.gguf_kernel_isa())


def run(args: argparse.Namespace) -> int:
    try:
        rows = parse_int_list(args.rows)
    except ValueError as exc:
        raise SystemExit(f"--rows: {exc}") from exc
    if min(rows) < 1 or max(rows) > MAX_SPECULATIVE_TOKENS + 1:
        raise SystemExit(f"--rows: each in [1, {MAX_SPECULATIVE_TOKENS + 1}], got {args.rows}")
    if args.steps < 1 or args.context < 2:
        raise SystemExit("--steps must be >= 1 and --context >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_gib=args.kv_cache_gib,
            threads=args.threads,
            max_num_seqs=1,
            seed=0,
        )
    )
    runner = engine.runner
    block_size = runner.kv_cache.spec.block_size
    num_tokens = args.context + sum(r * (WARM_STEPS + args.steps) for r in rows) + 1
    num_blocks = num_tokens // block_size + 1
    if num_blocks >= runner.kv_cache.num_blocks:
        raise SystemExit(
            f"--kv-cache-gib holds {runner.kv_cache.num_blocks} blocks; need {num_blocks + 1}"
        )
    (prompt,) = random_prompts(1, args.context, seed=0)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=num_tokens, ignore_eos=True)
    sequence = NewSequence(
        REQUEST_ID, prompt, len(prompt), list(range(1, num_blocks + 1)), 0, sampling
    )
    runner.execute(
        BatchPlan(0, new_sequences=[sequence], num_scheduled_tokens={REQUEST_ID: len(prompt)})
    )
    print(machine_header(torch.get_num_threads()))
    print(f"kernel isa: {kernel_isa()}")
    print(
        f"model: {engine.model_name}; dtype: {engine.dtype}; weights: "
        f"{engine.loaded.quantization}; decode steps: {decode_path(runner)}; "
        f"context {args.context}; median of {args.steps} steps\n"
    )
    table: list[list[object]] = []
    step_id = 1
    base_ms: float | None = None
    for num_rows in rows:
        median_ms = statistics.median(step_times_ms(runner, num_rows, args.steps, step_id))
        step_id += WARM_STEPS + args.steps
        if base_ms is None and num_rows == 1:
            base_ms = median_ms
        if base_ms is None:
            table.append([num_rows, num_rows - 1, median_ms, "-", "-", "-"])
            continue
        extra = median_ms / base_ms - 1
        acceptance = break_even_acceptance(num_rows - 1, extra)
        table.append(
            [
                num_rows,
                num_rows - 1,
                median_ms,
                f"{median_ms / base_ms:.2f}x",
                f"{max(extra, 0.0):.2f}" if num_rows > 1 else "-",
                "-" if num_rows == 1 else ("never" if acceptance is None else f"{acceptance:.2f}"),
            ]
        )
    print(format_table(HEADERS, table))
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "verify-rows",
        help="the worker's step for one sequence verifying 0-15 drafts (1-16 rows), on a model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (unset: the embedded model)"
    )
    parser.add_argument(
        "--rows", default="1,2,4,8,16", help="rows per step (the first should be 1)"
    )
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the steps")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row count")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=None)
    parser.set_defaults(func=run)


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser()
    add_parser(main_parser.add_subparsers(dest="command", required=True))
    parsed = main_parser.parse_args(["verify-rows", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
