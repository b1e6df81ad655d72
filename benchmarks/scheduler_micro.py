"""Micro-benchmark of the scheduler alone: microseconds per schedule() + update() in steady decode.

python -m benchmarks.scheduler_micro [--steps 500]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

PROMPT_LEN = 128
FAKE_TOKEN_ID = 7


@dataclass(frozen=True, slots=True)
class Case:
    num_requests: int
    prefix_caching: bool


@dataclass(frozen=True, slots=True)
class Timing:
    schedule_us: float
    update_us: float

    @property
    def total_us(self) -> float:
        return self.schedule_us + self.update_us


def build_scheduler(case: Case, num_steps: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max(case.num_requests, 1),
        max_num_batched_tokens=PROMPT_LEN * case.num_requests,  # all prefills in one step
        max_model_len=PROMPT_LEN + num_steps + 16,
        enable_prefix_caching=case.prefix_caching,
    )
    blocks_per_request = -(-config.max_model_len // config.block_size)
    scheduler = Scheduler(config, num_blocks=blocks_per_request * case.num_requests + 16)
    sampling = SamplingParams(max_new_tokens=num_steps + 8, ignore_eos=True)
    shared_prefix = list(range(100, 100 + PROMPT_LEN // 2))
    for i in range(case.num_requests):
        # Half of each prompt is a shared prefix (hits only when caching is on).
        own = [10_000 + i * PROMPT_LEN + j for j in range(PROMPT_LEN // 2)]
        request = Request(f"r{i}", shared_prefix + own, sampling, eos_token_ids=(2,))
        scheduler.add_request(request)
    return scheduler


def step(scheduler: Scheduler, now: float) -> tuple[float, float]:
    start = time.perf_counter()
    plan = scheduler.schedule(now)
    mid = time.perf_counter()
    # Every request is decoding, so every scheduled one samples (the fake worker costs nothing).
    result = StepResult(plan.step_id, dict.fromkeys(plan.num_scheduled_tokens, FAKE_TOKEN_ID))
    mid2 = time.perf_counter()
    scheduler.update(plan, result, now)
    end = time.perf_counter()
    return mid - start, end - mid2


def measure(case: Case, num_steps: int) -> Timing:
    scheduler = build_scheduler(case, num_steps)
    step(scheduler, 0.0)  # the prefill step: admission and prompt chunks, not timed
    assert scheduler.get_stats().num_running == case.num_requests
    schedule_s = update_s = 0.0
    for i in range(num_steps):
        schedule_dt, update_dt = step(scheduler, float(i + 1))
        schedule_s += schedule_dt
        update_s += update_dt
    scheduler.check_integrity()
    return Timing(1e6 * schedule_s / num_steps, 1e6 * update_s / num_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="timed decode steps per case")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest counts")
    args = parser.parse_args()
    cases = [Case(1, False), Case(64, False), Case(256, False), Case(256, True)]
    print(
        f"{'running':>8} {'prefix cache':>12} {'schedule us':>12} {'update us':>10} "
        f"{'total us':>9} {'us/request':>10}"
    )
    for case in cases:
        # The fastest run is the one least disturbed by other processes (as timeit does).
        timing = min(
            (measure(case, args.steps) for _ in range(args.repeats)), key=lambda t: t.total_us
        )
        print(
            f"{case.num_requests:>8} {'on' if case.prefix_caching else 'off':>12} "
            f"{timing.schedule_us:>12.1f} {timing.update_us:>10.1f} {timing.total_us:>9.1f} "
            f"{timing.total_us / case.num_requests:>10.2f}"
        )


if __name__ == "__main__":
    main()
