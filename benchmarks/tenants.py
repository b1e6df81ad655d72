"""`llmserve bench tenants`: two tenants' loads on one stack at once, with fair shares on and
off (--fair-share / --no-fair-share), side by side in one run.

    llmserve bench tenants --max-num-seqs 16 --flood 96 --late 4 --output-len 96

Tenant `flood` opens --flood streams at once; --delay seconds later tenant `late` sends
--late streams. Each tenant is an API key bound to it (a key file written here); `--weights
3:1` gives the two keys weights. Per configuration and tenant the table shows TTFT p50 / max and
output tok/s over the tenant's own streams, and the stack's total tok/s. A second table is the
cost of fair shares with one tenant only: --single streams of one key, on and off, total tok/s.
Both stacks are up at once and take turns (the machine's drift falls on both).
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

FLOOD_KEY = "sk-bench-flood"
LATE_KEY = "sk-bench-late"
CONFIGS = {"fair shares": "--fair-share", "first come first served": "--no-fair-share"}
HEADERS = ["scheduling", "tenant", "streams", "TTFT p50 s", "TTFT max s", "tok/s", "total tok/s"]
SINGLE_HEADERS = ["scheduling", "streams", "total tok/s", "/ first come first served"]


@dataclass
class Stream:
    sent_at: float
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    num_tokens: int = 0


async def _generate(stub: object, key: str, index: int, output_len: int) -> Stream:
    from protos.llmserve.v1 import text_pb2
    from services.client import auth_metadata

    stream = Stream(time.perf_counter())
    request = text_pb2.GenerateRequest(
        prompt=f"Request {index} ({key[-5:]}): tell a long story about a lighthouse keeper.",
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=output_len, ignore_eos=True
        ),
    )
    async for response in stub.Generate(request, metadata=auth_metadata(key), timeout=3600):  # type: ignore[attr-defined]
        if response.token_ids:
            now = time.perf_counter()
            stream.first_token_at = stream.first_token_at or now
            stream.last_token_at = now
            stream.num_tokens += len(response.token_ids)
    return stream


async def _two_tenants(target: str, args: argparse.Namespace) -> tuple[list[Stream], list[Stream]]:
    import grpc

    from protos.llmserve.v1 import text_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        flood = [
            asyncio.create_task(_generate(stub, FLOOD_KEY, i, args.output_len))
            for i in range(args.flood)
        ]
        await asyncio.sleep(args.delay)
        late = await asyncio.gather(
            *(_generate(stub, LATE_KEY, i, args.output_len) for i in range(args.late))
        )
        return await asyncio.gather(*flood), list(late)


async def _one_tenant(target: str, args: argparse.Namespace) -> list[Stream]:
    import grpc

    from protos.llmserve.v1 import text_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        return list(
            await asyncio.gather(
                *(_generate(stub, FLOOD_KEY, i, args.output_len) for i in range(args.single))
            )
        )


def _tok_s(streams: list[Stream]) -> float:
    start = min(s.sent_at for s in streams)
    end = max(s.last_token_at for s in streams)
    return sum(s.num_tokens for s in streams) / max(end - start, 1e-9)


def _ttfts(streams: list[Stream]) -> list[float]:
    return [s.first_token_at - s.sent_at for s in streams]


def run(args: argparse.Namespace) -> int:
    from services.stack import running_stack

    weight_flood, weight_late = (int(w) for w in args.weights.split(":"))
    print(machine_header(torch_threads=args.threads))
    print(
        f"flood: {args.flood} streams at once; late: {args.late} streams {args.delay} s later; "
        f"{args.output_len} greedy tokens each; --max-num-seqs {args.max_num_seqs}; "
        f"weights flood:late {weight_flood}:{weight_late}\n",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-tenants-") as name, ExitStack() as up:
        key_file = Path(name) / "keys.txt"
        key_file.write_text(
            f"{FLOOD_KEY} tenant=flood weight={weight_flood}\n"
            f"{LATE_KEY} tenant=late weight={weight_late}\n"
        )
        targets = {}
        for label, flag in CONFIGS.items():
            flags = [flag, "--api-key-file", str(key_file), "--tokenizer-replicas", "1"]
            flags += [
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--worker-threads",
                str(args.threads),
            ]
            flags += ["--max-waiting-requests", str(max(256, args.flood + args.late))]
            print(f"$ llmserve up {' '.join(flags)}  # {label}", flush=True)
            targets[label] = up.enter_context(running_stack(flags, startup_timeout_s=900.0)).public
        rows: list[list[object]] = []
        single: dict[str, float] = {}
        for label, target in targets.items():
            print(f"{label}: two tenants ...", file=sys.stderr, flush=True)
            flood, late = asyncio.run(_two_tenants(target, args))
            total = _tok_s([*flood, *late])
            for tenant, streams in (("flood", flood), ("late", late)):
                ttfts = _ttfts(streams)
                rows.append(
                    [
                        label,
                        tenant,
                        len(streams),
                        statistics.median(ttfts),
                        max(ttfts),
                        _tok_s(streams),
                        total,
                    ]
                )
        for label, target in targets.items():
            print(f"{label}: one tenant ...", file=sys.stderr, flush=True)
            single[label] = _tok_s(asyncio.run(_one_tenant(target, args)))
    print(f"\n{format_table(HEADERS, rows)}")
    baseline = single["first come first served"]
    single_rows = [[label, args.single, tok_s, tok_s / baseline] for label, tok_s in single.items()]
    print(f"\none tenant only:\n{format_table(SINGLE_HEADERS, single_rows)}")
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flood", type=int, default=96, help="streams tenant flood opens")
    parser.add_argument("--late", type=int, default=4, help="streams tenant late sends")
    parser.add_argument("--delay", type=float, default=5.0, help="seconds before late sends")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--weights", default="1:1", help="flood:late key weights")
    parser.add_argument("--single", type=int, default=64, help="streams of the one-tenant load")
    parser.add_argument("--threads", type=int, default=2, help="each worker's torch threads")
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "tenants", help="two tenants' loads at once, with fair shares on and off"
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench tenants")
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
