"""Baseline: Hugging Face transformers `generate` on the same model, greedy, static batches of
equal-length random prompts (no padding), to set beside `llmserve bench offline`.

llmserve bench hf --batch-sizes 1,8 --input-len 128 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.common import (
    Timer,
    format_table,
    machine_header,
    median,
    parse_int_list,
    peak_rss_mib,
    random_prompts,
    reset_peak_rss,
)
from services.common.model_source import embedded_model_path

HEADERS = [
    "batch",
    "input",
    "output",
    "prefill ms",
    "decode ms/step",
    "output tok/s",
    "peak RSS MiB",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class HFResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_ms: float
    """A generate() of one new token: the prompt's forward plus one sampling."""
    decode_ms_per_step: float
    """(full generate - prefill) / (output_len - 1)."""
    output_tokens_per_s: float
    peak_rss_mib: float

    def row(self) -> list[object]:
        return [
            self.batch_size,
            self.input_len,
            self.output_len,
            self.prefill_ms,
            self.decode_ms_per_step,
            self.output_tokens_per_s,
            self.peak_rss_mib,
        ]


def load_hf_model(dtype: torch.dtype) -> Any:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise SystemExit(
            "bench hf needs Hugging Face transformers (a test dependency): pip install -e '.[test]'"
        ) from exc
    path = embedded_model_path()
    # transformers dequantizes the GGUF's Q4_1 weights to `dtype` as it loads them.
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval()


def generate(model: Any, input_ids: torch.Tensor, num_new_tokens: int) -> float:
    """Seconds for one greedy generate() of exactly num_new_tokens (EOS cannot end it early)."""
    with torch.inference_mode(), Timer() as timer:
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    assert output.shape[1] == input_ids.shape[1] + num_new_tokens, output.shape
    return timer.elapsed_s


def measure(model: Any, batch_size: int, input_len: int, output_len: int, repeats: int) -> HFResult:
    input_ids = torch.tensor(random_prompts(batch_size, input_len, seed=0))
    reset_peak_rss()
    # Medians of alternating runs: on a shared machine one slow run must not make the
    # difference (total - prefill) meaningless.
    prefill_runs, total_runs = [], []
    for _ in range(repeats):
        prefill_runs.append(generate(model, input_ids, 1))
        total_runs.append(generate(model, input_ids, output_len))
    prefill_s, total_s = median(prefill_runs), median(total_runs)
    decode_s = (total_s - prefill_s) / (output_len - 1) if output_len > 1 else float("nan")
    return HFResult(
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        prefill_ms=1e3 * prefill_s,
        decode_ms_per_step=1e3 * decode_s,
        output_tokens_per_s=batch_size * output_len / total_s,
        peak_rss_mib=peak_rss_mib(),
    )


def run(args: argparse.Namespace) -> int:
    try:
        batch_sizes = parse_int_list(args.batch_sizes)
        if min(args.input_len, args.output_len, args.repeats) < 1:
            raise ValueError("--input-len, --output-len and --repeats must be >= 1")
    except ValueError as exc:
        print(f"bench hf: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_hf_model(DTYPES[args.dtype])
    # Warm-up at the measured prompt length, untimed: the first forward pays one-off costs.
    generate(model, torch.tensor(random_prompts(1, args.input_len, seed=1)), 2)
    print(machine_header(torch.get_num_threads()))
    print(f"transformers generate, {args.dtype}, greedy; repeats: {args.repeats}\n")
    results = []
    for batch_size in batch_sizes:
        print(f"batch {batch_size}...", file=sys.stderr)
        results.append(measure(model, batch_size, args.input_len, args.output_len, args.repeats))
    print(format_table(HEADERS, [result.row() for result in results]))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as sink:
            json.dump({"command": sys.argv, "results": [asdict(r) for r in results]}, sink)
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size; medians count")
    parser.add_argument("--json-out", default=None)
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "hf", help="transformers generate baseline on the same model", description=__doc__
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    configure_parser(parser)
    return int(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
