#!/usr/bin/env python3
"""The decode step in containers against the same stack on the host, side by side in one run:
`llmserve up` (started here) and the compose stack (already up on host networking, started by
scripts/compose_decode_compare.sh) take turns, round after round, with the same greedy
requests (as `llmserve bench interleaved`), so the drift of a shared machine falls on both.
Prints the medians of TPOT p50 (the decode step as a client sees it) and output tok/s, and the
container's ratio to the host (target: TPOT within 10 %).

    PYTHONPATH=. .venv/bin/python scripts/docker/decode_compare.py --compose 127.0.0.1:50151
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

from benchmarks.common import machine_header
from benchmarks.interleaved import Prompts, RoundResult, run_rounds, stack_system
from services.common.tables import format_table
from services.stack import running_stack

HEADERS = ["system", "TPOT p50 ms", "TPOT / host", "output tok/s", "tok/s / host"]
VOCAB = 49152  # SmolLM2's; the prompts are token ids below it


def rows(results: dict[str, list[RoundResult]]) -> list[list[object]]:
    medians = {
        name: (
            statistics.median(r.tpot_p50_ms for r in rounds),
            statistics.median(r.output_tok_s for r in rounds),
        )
        for name, rounds in results.items()
    }
    host_tpot, host_tok_s = medians["host"]
    return [
        [name, tpot, tpot / host_tpot, tok_s, tok_s / host_tok_s]
        for name, (tpot, tok_s) in medians.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compose", required=True, help="the compose stack's gRPC HOST:PORT")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=1, help="requests per round")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--host-flags",
        default="--tokenizer-replicas 1",
        help="`llmserve up` flags of the host stack (default: one pair, one replica)",
    )
    args = parser.parse_args()

    print(machine_header(torch_threads=os.cpu_count() or 1))
    print(
        f"rounds: {args.rounds}, each system in turn: {args.concurrency} requests of "
        f"{args.input_len} prompt + {args.output_len} greedy tokens (ignore_eos)\n",
        flush=True,
    )
    with running_stack(args.host_flags.split(), startup_timeout_s=900.0) as host:
        systems: dict[str, Callable[[Prompts], RoundResult]] = {
            "host": stack_system(host.public, args.output_len),
            "compose": stack_system(args.compose, args.output_len),
        }
        results = run_rounds(systems, args.rounds, args.concurrency, args.input_len, VOCAB)
    table = rows(results)
    print(f"\n{format_table(HEADERS, table)}")
    ratio = float(table[1][2])  # type: ignore[arg-type]
    verdict = "within" if ratio <= 1.10 else "NOT within"
    print(f"medians over the rounds; the container's decode step is {verdict} 10 % of the host's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
