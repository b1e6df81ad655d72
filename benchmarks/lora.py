"""`llmserve bench lora`: a 16-user load whose requests name 1, 4 or 16 distinct LoRA adapters,
against the same load on the base model, on one stack, side by side in one run.

    llmserve bench lora --users 16 --adapters 1,4,16 --rounds 3

The stack starts with --lora-modules: --max-adapters random adapters of the embedded model
(rank --rank on every linear projection, written here in PEFT's format) and --max-loras
enough slots for them all. Each user sends --requests-per-user requests one after another
(--prompt-len tokens in, --output-len greedy tokens out); user u's requests name adapter
u mod k (k = 0: the base model). The loads take turns, --rounds times (the machine's drift
falls on every load alike); the table shows the median round per load, and each load's tok/s
as a fraction of the base's (the target: >= 0.8 with 4 adapters).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import format_table, machine_header
from benchmarks.lora_adapters import ALL_LINEAR

HEADERS = [
    "load",
    "adapters",
    "output tok/s",
    "/ base",
    "TTFT p50 ms",
    "TPOT p50 ms",
    "rounds",
]


@dataclass
class Stream:
    sent_at: float
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    num_tokens: int = 0

    @property
    def tpot_s(self) -> float:
        if self.num_tokens < 2:
            return 0.0
        return (self.last_token_at - self.first_token_at) / (self.num_tokens - 1)


async def _user(stub: object, user: int, model: str, args: argparse.Namespace) -> list[Stream]:
    from protos.llmserve.v1 import text_pb2

    streams = []
    for index in range(args.requests_per_user):
        stream = Stream(time.perf_counter())
        request = text_pb2.GenerateRequest(
            # Distinct per user and request: no prefix cache hit flatters any load.
            prompt_token_ids=[
                (7919 * user + 104729 * index + 31 * j) % 40000 + 100
                for j in range(args.prompt_len)
            ],
            model=model,
            sampling=text_pb2.SamplingParams(
                temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True
            ),
        )
        async for response in stub.Generate(request, timeout=3600):  # type: ignore[attr-defined]
            if response.token_ids:
                now = time.perf_counter()
                stream.first_token_at = stream.first_token_at or now
                stream.last_token_at = now
                stream.num_tokens += len(response.token_ids)
        streams.append(stream)
    return streams


async def _load(target: str, names: list[str], args: argparse.Namespace) -> list[Stream]:
    import grpc

    from protos.llmserve.v1 import text_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        per_user = await asyncio.gather(
            *(
                _user(stub, user, names[user % len(names)] if names else "", args)
                for user in range(args.users)
            )
        )
    return [stream for streams in per_user for stream in streams]


def _tok_s(streams: list[Stream]) -> float:
    start = min(s.sent_at for s in streams)
    end = max(s.last_token_at for s in streams)
    return sum(s.num_tokens for s in streams) / max(end - start, 1e-9)


def run(args: argparse.Namespace) -> int:
    from benchmarks.lora_adapters import write_random_adapter
    from services.common.model_source import embedded_model_path
    from services.stack import running_stack

    counts = [int(c) for c in args.adapters.split(",")]
    num_adapters = max(counts)
    print(machine_header(torch_threads=args.threads))
    print(
        f"{args.users} users x {args.requests_per_user} requests, {args.prompt_len} prompt + "
        f"{args.output_len} greedy tokens each; adapters: rank {args.rank} on "
        f"{args.targets}; --max-num-seqs {args.max_num_seqs}\n",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-lora-") as name, ExitStack() as up:
        model = embedded_model_path()
        modules = []
        for index in range(num_adapters):
            print(f"writing adapter {index + 1}/{num_adapters}", file=sys.stderr, flush=True)
            path = write_random_adapter(
                Path(name) / f"adapter-{index}",
                model,
                rank=args.rank,
                seed=index,
                targets=args.targets.split(","),
            )
            modules += ["--lora-modules", f"adapter-{index}={path}"]
        flags = [
            "--tokenizer-replicas",
            "1",
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--worker-threads",
            str(args.threads),
            "--max-loras",
            str(max(num_adapters, 1)),
            "--max-cpu-loras",
            str(max(num_adapters, 1)),
            "--max-lora-rank",
            str(args.rank),
            *modules,
        ]
        print(f"$ llmserve up {' '.join(flags)}", flush=True)
        target = up.enter_context(running_stack(flags, startup_timeout_s=900.0)).public
        loads = {
            "base": [],
            **{f"{k} adapters": [f"adapter-{i}" for i in range(k)] for k in counts},
        }
        asyncio.run(_load(target, [], argparse.Namespace(**{**vars(args), "requests_per_user": 1})))
        measured: dict[str, list[list[Stream]]] = {label: [] for label in loads}
        for round_index in range(args.rounds):
            for label, names in loads.items():
                print(f"round {round_index + 1}: {label} ...", file=sys.stderr, flush=True)
                measured[label].append(asyncio.run(_load(target, names, args)))
    rows: list[list[object]] = []
    base_tok_s = statistics.median(_tok_s(streams) for streams in measured["base"])
    for label, rounds in measured.items():
        tok_s = statistics.median(_tok_s(streams) for streams in rounds)
        streams = [s for r in rounds for s in r]
        ttft = statistics.median(s.first_token_at - s.sent_at for s in streams) * 1000
        tpot = statistics.median(s.tpot_s for s in streams) * 1000
        rows.append([label, len(loads[label]), tok_s, tok_s / base_tok_s, ttft, tpot, len(rounds)])
    print(f"\n{format_table(HEADERS, rows)}")
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--adapters", default="1,4,16", help="distinct adapters per load")
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--targets",
        default=",".join(ALL_LINEAR),
        help="the projections each adapter adapts (default: every linear one)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "lora", help="a 16-user load over 1, 4 and 16 LoRA adapters against the base model"
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench lora")
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
