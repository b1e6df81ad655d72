"""Offline throughput of the in-process engine: one markdown table per dtype, a row per
(batch size, input x output shape), every step timed.

llmserve bench offline --dtypes float32 --batch-sizes 1,8 --shapes 128x16
python -m benchmarks.offline_table --help
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict, dataclass, field
from time import perf_counter

import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from benchmarks.common import (
    MiB,
    format_table,
    machine_header,
    median,
    parse_int_list,
    parse_shapes,
    peak_rss_mib,
    random_prompts,
    reset_peak_rss,
)
from services.common.serving_config import DTypeName
from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.config import GiB, resolve_dtype
from services.worker.kv_cache import KVCacheSpec
from services.worker.loaded_model import LoadedModel

BLOCK_SIZE = 16
WARMUP_PROMPT_LEN = 128
WARMUP_OUTPUT_LEN = 8
WARMUP_KV_CACHE_BYTES = 64 * MiB
DTYPES: tuple[DTypeName, ...] = ("auto", "float32", "bfloat16", "float16")
HEADERS = [
    "batch",
    "input",
    "output",
    "prefill ms",
    "decode ms/step",
    "output tok/s",
    "total tok/s",
    "peak KV MiB",
    "peak RSS MiB",
    "preemptions",
]


@dataclass(frozen=True, slots=True)
class Cell:
    dtype: DTypeName
    batch_size: int
    input_len: int
    output_len: int


@dataclass(slots=True)
class CellRun:
    """One timed run of a cell."""

    prefill_ms: float
    """Submit until every request has its first token."""
    decode_ms_per_step: float
    """Median step over the steps where all sequences decode and none prefills."""
    output_tokens_per_s: float
    total_tokens_per_s: float
    peak_kv_mib: float
    peak_rss_mib: float
    num_preemptions: int
    kv_cache_mib: float
    step_ms: list[float] = field(default_factory=list)


def run_cell(loaded: LoadedModel, cell: Cell, args: argparse.Namespace, seed: int) -> CellRun:
    config = engine_config(loaded, cell, args)
    prompts = random_prompts(cell.batch_size, cell.input_len, seed=seed)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cell.output_len, ignore_eos=True)
    gc.collect()  # the previous cell's KV cache must be gone before the peak-RSS mark resets
    reset_peak_rss()
    engine = LLMEngine(config, loaded=loaded)
    bytes_per_block = engine.kv_cache.spec.bytes_per_block

    started: set[str] = set()  # membership only
    num_finished = 0
    step_ms: list[float] = []
    decode_ms: list[float] = []
    peak_kv_blocks = 0
    prefill_s = float("nan")
    start = perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, sampling)
    while engine.has_unfinished_requests():
        # A step with every sequence past its first token and none finished is a pure decode
        # of the whole batch, unless it preempts (then someone re-prefills): checked after.
        all_decoding = len(started) == cell.batch_size and num_finished == 0
        preemptions_before = engine.get_stats().num_preemptions
        step_start = perf_counter()
        events = engine.step()
        step_end = perf_counter()
        step_ms.append(1e3 * (step_end - step_start))
        stats = engine.get_stats()
        if all_decoding and stats.num_preemptions == preemptions_before:
            decode_ms.append(step_ms[-1])
        # Read after update(), so blocks the finishing requests just freed are missed: at most
        # one block per sequence, on the last step only.
        peak_kv_blocks = max(peak_kv_blocks, stats.num_total_blocks - stats.num_free_blocks)
        for event in events:
            if event.new_token_ids and event.request_id not in started:
                started.add(event.request_id)
                if len(started) == cell.batch_size:
                    prefill_s = step_end - start
            num_finished += event.finished
    total_s = perf_counter() - start
    num_output = cell.batch_size * cell.output_len
    return CellRun(
        prefill_ms=1e3 * prefill_s,
        decode_ms_per_step=median(decode_ms),
        output_tokens_per_s=num_output / total_s,
        total_tokens_per_s=(num_output + cell.batch_size * cell.input_len) / total_s,
        peak_kv_mib=peak_kv_blocks * bytes_per_block / MiB,
        peak_rss_mib=peak_rss_mib(),
        num_preemptions=engine.get_stats().num_preemptions,
        kv_cache_mib=engine.num_kv_blocks * bytes_per_block / MiB,
        step_ms=step_ms,
    )


def engine_config(loaded: LoadedModel, cell: Cell, args: argparse.Namespace) -> EngineConfig:
    """The cell's engine. Without --kv-cache-gib the cache fits the whole batch at full length
    (plus the admission watermark), so no cell preempts and the table measures compute."""
    if args.kv_cache_gib is not None:
        kv_cache_gib = args.kv_cache_gib
    else:
        spec = KVCacheSpec.for_model(loaded.model.architecture, BLOCK_SIZE, loaded.dtype)
        blocks_per_seq = -(-(cell.input_len + cell.output_len) // BLOCK_SIZE)
        num_blocks = int(cell.batch_size * blocks_per_seq * 1.02) + 2
        kv_cache_gib = num_blocks * spec.bytes_per_block / GiB
    return EngineConfig(
        model=args.model,
        dtype=cell.dtype,
        kv_cache_gib=kv_cache_gib,
        block_size=BLOCK_SIZE,
        # Exactly the batch: step graphs are compiled at start for every batch-size bucket up
        # to max_num_seqs, and buckets above the batch would never run.
        max_num_seqs=cell.batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
        enforce_eager=args.enforce_eager,
        speculation=False if args.no_speculation else None,
        seed=0,
    )


def warm_up(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """One short request, so one-off costs (allocator growth, kernel selection) stay untimed."""
    config = EngineConfig(
        model=args.model,
        kv_cache_gib=WARMUP_KV_CACHE_BYTES / GiB,
        threads=args.threads,
        enforce_eager=args.enforce_eager,
        seed=0,
    )
    engine = LLMEngine(config, loaded=loaded)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True)
    engine.generate(random_prompts(1, WARMUP_PROMPT_LEN, seed=12345), sampling)


def summarize(runs: list[CellRun]) -> CellRun:
    """The median of each column over the repeats (columns may come from different runs)."""

    def column(name: str) -> float:
        return median([getattr(run, name) for run in runs])

    return CellRun(
        prefill_ms=column("prefill_ms"),
        decode_ms_per_step=column("decode_ms_per_step"),
        output_tokens_per_s=column("output_tokens_per_s"),
        total_tokens_per_s=column("total_tokens_per_s"),
        peak_kv_mib=column("peak_kv_mib"),
        peak_rss_mib=column("peak_rss_mib"),
        num_preemptions=max(run.num_preemptions for run in runs),
        kv_cache_mib=column("kv_cache_mib"),
    )


def table_row(cell: Cell, result: CellRun) -> list[object]:
    return [
        cell.batch_size,
        cell.input_len,
        cell.output_len,
        result.prefill_ms,
        result.decode_ms_per_step,
        result.output_tokens_per_s,
        result.total_tokens_per_s,
        result.peak_kv_mib,
        result.peak_rss_mib,
        result.num_preemptions,
    ]


def parse_dtypes(text: str) -> list[DTypeName]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    dtypes = [dtype for name in names for dtype in DTYPES if dtype == name]
    if not names or len(dtypes) != len(names):
        raise ValueError(f"--dtypes takes some of {', '.join(DTYPES)}; got {text!r}")
    return dtypes


def run(args: argparse.Namespace) -> int:
    try:
        dtypes = parse_dtypes(args.dtypes)
        batch_sizes = parse_int_list(args.batch_sizes)
        shapes = parse_shapes(args.shapes)
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    except ValueError as exc:
        print(f"bench offline: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_header(torch.get_num_threads()))
    # The weights are quantized at load, once per dtype; EngineConfig.quantization is not
    # consulted when the engine is handed a loaded model.
    quantization = args.quantization or EngineConfig().quantization
    print(
        f"max_num_batched_tokens: {args.max_num_batched_tokens}; repeats: {args.repeats}; "
        f"quantization: {quantization}; enforce_eager: {args.enforce_eager}\n"
    )
    cells = [Cell(d, b, i, o) for d in dtypes for b in batch_sizes for i, o in shapes]
    records: list[dict[str, object]] = []
    progress = tqdm(total=len(cells) * args.repeats, desc="cells", file=sys.stderr)
    for dtype in dtypes:
        loaded = LoadedModel.load(
            args.model, resolve_dtype(dtype, "cpu"), quantization=quantization
        )
        progress.set_postfix_str(f"{dtype} warm-up")
        warm_up(loaded, args)
        rows = []
        for cell in (c for c in cells if c.dtype == dtype):
            progress.set_postfix_str(
                f"{dtype} B={cell.batch_size} {cell.input_len}x{cell.output_len}"
            )
            runs = []
            for repeat in range(args.repeats):
                runs.append(run_cell(loaded, cell, args, seed=repeat))
                progress.update()
            result = summarize(runs)
            rows.append(table_row(cell, result))
            records.append(
                {**asdict(cell), "median": asdict(result), "runs": [asdict(r) for r in runs]}
            )
        tqdm.write(f"### {dtype}\n\n{format_table(HEADERS, rows)}\n", file=sys.stdout)
        del loaded
    progress.close()
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as sink:
            json.dump({"command": sys.argv, "cells": records}, sink, indent=1)
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated")
    parser.add_argument(
        "--shapes", default="128x128,1024x128", help="comma-separated INPUTxOUTPUT token lengths"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="fixed KV cache for every cell (default: sized per cell to hold the whole batch)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell; the median counts")
    parser.add_argument(
        "--quantization",
        default=None,
        help="weight format, as `llmserve up --quantization` (default: the engine's)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no compiled step graphs")
    parser.add_argument(
        "--no-speculation", action="store_true", help="every draft proposer off: one token a step"
    )
    parser.add_argument("--json-out", default=None, help="also write every run here")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: embedded)"
    )
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "offline", help="in-process engine throughput table", description=__doc__
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
