"""Capacity at a fixed KV budget, paged vs contiguous max-length allocation: the scheduler alone,
driven by a fake worker that ends each request with EOS at a drawn length (no model, no torch).

llmserve bench capacity [--num-requests 512] [--kv-budget-tokens 32768]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass

from benchmarks.common import SAFE_TOKEN_RANGE, command_line, format_table, mean, uniform_int
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, StepResult
from services.scheduler.config import AllocationPolicy, SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

EOS_TOKEN_ID = 2
FILLER_TOKEN_ID = 7  # what the fake worker samples before a request's drawn stop
POLICIES: tuple[AllocationPolicy, ...] = ("paged", "max_length")
HEADERS = [
    "policy",
    "peak running",
    "mean running",
    "mean running (queue non-empty)",
    "steps",
    "mean KV utilisation %",
    "preemptions",
]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int
    """The fake worker emits EOS as this output token."""


def make_workload(
    num_requests: int,
    seed: int,
    prompt_lens: tuple[int, int] = (64, 512),
    output_lens: tuple[int, int] = (16, 512),
) -> list[WorkloadRequest]:
    """Prompt and output lengths uniform in the inclusive ranges; token ids never EOS."""
    rng = random.Random(seed)
    low_token, high_token = SAFE_TOKEN_RANGE
    workload = []
    for _ in range(num_requests):
        prompt_len = uniform_int(rng, *prompt_lens)
        prompt = [uniform_int(rng, low_token, high_token - 1) for _ in range(prompt_len)]
        workload.append(WorkloadRequest(prompt, uniform_int(rng, *output_lens)))
    return workload


class StopAtLengthWorker:
    """Follows the worker's view of each sequence from the plans (token count, computed
    tokens) and samples one token whenever a sequence's scheduled range reaches its end."""

    def __init__(self, output_lens: dict[str, int]) -> None:
        self.output_lens = output_lens
        self.num_tokens: dict[str, int] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, plan: BatchPlan) -> StepResult:
        for request_id in plan.finished_request_ids:  # finished or preempted: forget it
            del self.num_tokens[request_id], self.num_prompt_tokens[request_id]
            del self.num_computed[request_id]
        for seq in plan.new_sequences:
            self.num_tokens[seq.request_id] = len(seq.token_ids)
            self.num_prompt_tokens[seq.request_id] = seq.num_prompt_tokens
            self.num_computed[seq.request_id] = seq.num_computed_tokens
        sampled = {}
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            self.num_computed[request_id] += num_scheduled
            if self.num_computed[request_id] < self.num_tokens[request_id]:
                continue  # a partial prefill chunk samples nothing
            self.num_tokens[request_id] += 1
            num_output = self.num_tokens[request_id] - self.num_prompt_tokens[request_id]
            stop = num_output >= self.output_lens[request_id]
            sampled[request_id] = EOS_TOKEN_ID if stop else FILLER_TOKEN_ID
        return StepResult(step_id=plan.step_id, sampled_token_ids=sampled)


@dataclass(frozen=True, slots=True)
class CapacityResult:
    policy: str
    peak_running: int
    mean_running: float
    mean_running_saturated: float
    """Mean over the steps that left requests waiting: the budget, not the tail, is the limit."""
    num_steps: int
    mean_kv_utilisation: float
    """Tokens whose KV is held / tokens of the blocks reserved, averaged over steps."""
    num_preemptions: int

    def numbers(self) -> list[float]:
        return [
            self.peak_running,
            self.mean_running,
            self.mean_running_saturated,
            self.num_steps,
            100 * self.mean_kv_utilisation,
            self.num_preemptions,
        ]

    def row(self) -> list[object]:
        return [self.policy, *self.numbers()]


def simulate(
    workload: list[WorkloadRequest], policy: AllocationPolicy, args: argparse.Namespace
) -> CapacityResult:
    config = SchedulerConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        # Random prompts share nothing, and max_length cannot cache: compare allocation only.
        enable_prefix_caching=False,
        allocation_policy=policy,
        max_waiting_requests=len(workload),
    )
    scheduler = Scheduler(config, num_blocks=args.kv_budget_tokens // args.block_size)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    output_lens = {}
    for i, item in enumerate(workload):
        request_id = f"req-{i}"
        output_lens[request_id] = item.output_len
        scheduler.add_request(
            Request(request_id, item.prompt_token_ids, sampling, eos_token_ids=(EOS_TOKEN_ID,))
        )
    worker = StopAtLengthWorker(output_lens)
    running: list[int] = []
    running_saturated: list[int] = []
    utilisation: list[float] = []
    while scheduler.has_unfinished_requests():
        now = float(len(running))  # a step counter as the clock: no deadlines here
        plan = scheduler.schedule(now)
        # Counted between schedule and update: the sequences holding KV in this forward.
        num_running = len(scheduler.running)
        scheduler.update(plan, worker.step(plan), now)
        running.append(num_running)
        if scheduler.waiting:
            running_saturated.append(num_running)
        stats = scheduler.get_stats()
        reserved = (stats.num_total_blocks - stats.num_free_blocks) * args.block_size
        if reserved:
            held = sum(request.num_computed_tokens for request in scheduler.running)
            utilisation.append(held / reserved)
    scheduler.check_integrity()
    return CapacityResult(
        policy=policy,
        peak_running=max(running),
        mean_running=mean(running),
        mean_running_saturated=mean(running_saturated),
        num_steps=len(running),
        mean_kv_utilisation=mean(utilisation),
        num_preemptions=scheduler.num_preemptions,
    )


def ratio_row(paged: CapacityResult, max_length: CapacityResult) -> list[object]:
    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    pairs = zip(paged.numbers(), max_length.numbers(), strict=True)
    return ["ratio paged/max_length", *(ratio(a, b) for a, b in pairs)]


def run(args: argparse.Namespace) -> int:
    if args.kv_budget_tokens < args.block_size or args.num_requests < 1:
        print("bench capacity: need --num-requests >= 1 and one block of budget", file=sys.stderr)
        return 2
    workload = make_workload(args.num_requests, args.seed)
    results = {policy: simulate(workload, policy, args) for policy in POLICIES}
    rows = [result.row() for result in results.values()]
    rows.append(ratio_row(results["paged"], results["max_length"]))
    num_blocks = args.kv_budget_tokens // args.block_size
    print(f"command: `{command_line()}`")
    print(
        f"workload: {args.num_requests} requests at once (seed {args.seed}), prompts uniform "
        f"[64, 512], max_new_tokens {args.max_new_tokens}, EOS at an output length uniform "
        f"[16, 512]; KV budget {args.kv_budget_tokens} tokens = {num_blocks} blocks of "
        f"{args.block_size}; max_model_len {args.max_model_len}; max_num_seqs "
        f"{args.max_num_seqs}; max_num_batched_tokens {args.max_num_batched_tokens}\n"
    )
    print(format_table(HEADERS, rows))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as sink:
            json.dump({"command": sys.argv, "results": [asdict(r) for r in results.values()]}, sink)
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--kv-budget-tokens", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--max-num-seqs", type=int, default=512, help="high, so KV (not seats) is the limit"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "capacity", help="paged vs max-length KV allocation (simulated)", description=__doc__
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    configure_parser(parser)
    return int(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
