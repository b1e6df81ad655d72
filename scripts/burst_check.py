"""Fires one burst of short streams at a fresh stack at once and counts the refusals.

    python scripts/burst_check.py                       # 300 streams, default limits
    python scripts/burst_check.py --burst 400 -- --max-num-seqs 64

A burst no larger than --max-num-seqs + --max-waiting-requests (128 + 256 by default) should
see no refusal, however fast it arrives; a larger one exactly the excess, each refusal with
its retry pushback. Not a test: 300 streams take over a minute on two CPU cores (the e2e test,
tests/e2e/test_burst_admission.py, runs the same check with 4 seats and 8 waiting).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.common.grpc_server import RETRY_PUSHBACK_METADATA_KEY
from services.stack import running_stack

# As the e2e stack: an eager float32 worker starts in seconds.
STACK_FLAGS = ["--tokenizer-replicas", "2", "--dtype", "float32", "--enforce-eager"]


@dataclass
class Outcome:
    finished: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    pushbacks_ms: list[int] = field(default_factory=list)


async def burst(address: str, size: int, max_new_tokens: int, timeout_s: float) -> Outcome:
    outcome = Outcome()
    sampling = text_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)

        async def one(index: int) -> None:
            request = text_pb2.GenerateRequest(prompt=f"Item {index}:", sampling=sampling)
            try:
                async for _ in stub.Generate(request, timeout=timeout_s):
                    pass
            except grpc.aio.AioRpcError as exc:
                outcome.refused[exc.code().name] += 1
                pushback = dict(exc.trailing_metadata() or ()).get(RETRY_PUSHBACK_METADATA_KEY)
                if isinstance(pushback, str) and pushback.isdigit():
                    outcome.pushbacks_ms.append(int(pushback))
                return
            outcome.finished += 1

        await asyncio.gather(*(one(i) for i in range(size)))
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=300, help="streams sent at once")
    parser.add_argument("--max-new-tokens", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("stack_flags", nargs="*", help="more `llmserve up` flags, after --")
    args = parser.parse_args()
    with running_stack([*STACK_FLAGS, *args.stack_flags]) as stack:
        started = time.perf_counter()
        outcome = asyncio.run(burst(stack.public, args.burst, args.max_new_tokens, args.timeout_s))
        elapsed_s = time.perf_counter() - started
        stats = stack.wait_all_blocks_free(timeout_s=30)
    refused = sum(outcome.refused.values())
    pushbacks = outcome.pushbacks_ms
    pushback = f"{min(pushbacks)}..{max(pushbacks)}" if pushbacks else "-"
    print("| burst | finished | refused | by code | pushback ms | seconds | blocks free |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.burst} | {outcome.finished} | {refused} | {dict(outcome.refused) or '-'} "
        f"| {pushback} | {elapsed_s:.1f} | {stats.num_free_blocks}/{stats.num_total_blocks} |"
    )


if __name__ == "__main__":
    main()
