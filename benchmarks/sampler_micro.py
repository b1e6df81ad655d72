"""Micro-benchmark of the sampler alone: microseconds per build_sampling_metadata and per call.

python -m benchmarks.sampler_micro [--vocab-size 49152] [--batch-sizes 1,32,256] [--device cpu]
                                       [--threads N]

Logits are Gaussian with fixed seeds. "peaked" scales them by 4 so the 0.9 nucleus at
temperature 0.8 holds a few dozen tokens (median 36 of 49152), roughly what a language model
gives mid-sentence; "flat" (scale 1) puts ~25k tokens in it, the worst case for top-p.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.contracts.sampling_params import SamplingParams
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import SamplerRow, build_sampling_metadata

PROMPT_LEN = 512
OUTPUT_LEN = 128
EOS_TOKEN_IDS = (2,)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    sampling: SamplingParams
    logit_scale: float = 4.0
    seeded: bool = False


CASES = [
    Case("greedy (fast path)", SamplingParams(temperature=0.0)),
    Case("top-p 0.9, peaked", SamplingParams(temperature=0.8, top_p=0.9)),
    Case("top-p 0.9, flat", SamplingParams(temperature=0.8, top_p=0.9), logit_scale=1.0),
    Case("top-k 50 + top-p 0.9", SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
    Case(
        "top-k 50 + top-p 0.9, seeded",
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
        seeded=True,
    ),
    Case(
        "top-k+top-p + penalties",
        SamplingParams(
            temperature=0.8,
            top_k=50,
            top_p=0.9,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        ),
    ),
]


def build_rows(case: Case, batch_size: int, vocab_size: int) -> list[SamplerRow]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(batch_size):
        sampling = case.sampling
        if case.seeded:
            sampling = SamplingParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                seed=i,
            )
        prompt = torch.randint(vocab_size, (PROMPT_LEN,), generator=generator).tolist()
        output = torch.randint(vocab_size, (OUTPUT_LEN,), generator=generator).tolist()
        rows.append(SamplerRow(sampling, prompt, output, EOS_TOKEN_IDS))
    return rows


def time_us(fn: Callable[[], object], device: torch.device, budget_s: float = 1.0) -> float:
    """Median of repeated calls, at least 5 and as many as fit in the budget (max 200)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 200):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default). On a shared machine 1 gives stable numbers:"
        " busy cores make multi-threaded kernels spin and vary 10x.",
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    print(
        f"sampler micro-benchmark: V={args.vocab_size}, device={device}, "
        f"torch threads={torch.get_num_threads()}, penalties over {PROMPT_LEN} prompt + "
        f"{OUTPUT_LEN} output tokens per row; median µs"
    )
    header = f"{'case':<30}" + "".join(
        f"{f'B={b} build':>14}{f'B={b} call':>14}" for b in batch_sizes
    )
    print(header)
    print("-" * len(header))
    sampler = Sampler(seed=0)
    for case in CASES:
        cells = []
        for batch_size in batch_sizes:
            generator = torch.Generator().manual_seed(0)
            logits = torch.randn(batch_size, args.vocab_size, generator=generator)
            logits = (logits * case.logit_scale).to(device)
            rows = build_rows(case, batch_size, args.vocab_size)
            metadata = build_sampling_metadata(rows, args.vocab_size, device)
            build_us = time_us(
                lambda rows=rows: build_sampling_metadata(rows, args.vocab_size, device), device
            )
            # Penalties write into the logits; reusing the same tensor only drifts its values,
            # which does not change the work done.
            call_us = time_us(
                lambda logits=logits, metadata=metadata: sampler(logits, metadata), device
            )
            cells.append(f"{build_us:>14.0f}{call_us:>14.0f}")
        print(f"{case.name:<30}" + "".join(cells))


if __name__ == "__main__":
    main()
