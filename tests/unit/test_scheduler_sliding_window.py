"""The scheduler in a model whose every layer has a sliding window: a running request gives back
the blocks before its window, so a long decode holds about the window, not its history. The
fake worker reads only the window, and checks those positions still hold the sequence's own
tokens, written before any other sequence's writes in the step: a block released too early and
reused fails there. Streams are what they are without a window (the fake samples by position)."""

from __future__ import annotations

import pytest

from services.scheduler.features.sliding_window import RELEASED_BLOCK
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import (
    BLOCK_SIZE,
    FakeWorker,
    check_worker_in_sync,
    create_requests,
    create_scheduler,
)
from tests.unit.test_overlapped_scheduling import (
    DRIVERS,
    position_sampler,
    run_workload,
    streamed,
)
from tests.unit.test_scheduler_choices import assert_all_free, choice_sampler, tokens_of
from tests.unit.test_scheduler_speculation import guesser

WINDOW = 40


def num_held_blocks(scheduler: Scheduler) -> int:
    stats = scheduler.get_stats()
    return stats.num_total_blocks - stats.num_free_blocks


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_long_decode_holds_only_its_window(driver: str) -> None:
    scheduler = create_scheduler(num_blocks=64, sliding_window=WINDOW)
    worker = FakeWorker(sample=position_sampler(eos_every=10**9), sliding_window=WINDOW)
    (request,) = create_requests(1, num_tokens=100, max_new_tokens=400)
    scheduler.add_request(request)
    held: list[int] = []

    def watch(step: int) -> None:
        if request.num_output_tokens >= 2:  # a decode step has run since the prefill
            held.append(num_held_blocks(scheduler))
            check_worker_in_sync(scheduler, worker)

    events = DRIVERS[driver](scheduler, worker, between=watch)
    assert sum(len(e.new_token_ids) for e in events["req0"]) == 400  # 500 tokens: 32 blocks
    assert len(held) > 390
    # The window's blocks, the next token's, and one planned ahead (overlapped).
    assert max(held) <= -(-WINDOW // BLOCK_SIZE) + 2
    assert_all_free(scheduler)


def test_blocks_go_back_as_soon_as_the_window_passes_them() -> None:
    scheduler = create_scheduler(num_blocks=64, sliding_window=WINDOW)
    worker = FakeWorker(sliding_window=WINDOW)
    (request,) = create_requests(1, num_tokens=100, max_new_tokens=20)
    scheduler.add_request(request)
    plan = scheduler.schedule(0.0)  # the whole prompt: 7 blocks
    scheduler.update(plan, worker.step(plan), 0.0)
    assert num_held_blocks(scheduler) == 7
    plan = scheduler.schedule(1.0)  # the decode at position 100 sees 61..100: blocks 3..6
    assert scheduler.kv.get_block_table("req0")[:4] == [RELEASED_BLOCK] * 3 + [
        worker.block_tables["req0"][3]
    ]
    assert num_held_blocks(scheduler) == 4
    assert not plan.block_deltas and not plan.block_truncations  # the worker's table stays
    scheduler.update(plan, worker.step(plan), 1.0)
    check_worker_in_sync(scheduler, worker)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_stream_what_they_stream_without_a_window(seed: int, driver: str) -> None:
    """Chunked prefill, preemption, prefix hits and stop tokens, with a window of a block and
    a bit: the same tokens, every block free at the end."""
    plain, _, _ = run_workload(seed, DRIVERS["serial"])
    windowed, scheduler, worker = run_workload(seed, DRIVERS[driver], sliding_window=20)
    assert streamed(windowed) == streamed(plain)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks
    assert not worker.token_ids


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("seed", range(10))
def test_random_workloads_with_drafts_and_a_window(seed: int, driver: str) -> None:
    plain, _, _ = run_workload(seed, DRIVERS["serial"])
    windowed, scheduler, _ = run_workload(
        seed, DRIVERS[driver], speculative_ngram=5, guess=guesser, sliding_window=20
    )
    assert streamed(windowed) == streamed(plain)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks


def blocks_held_over_the_workloads(sliding_window: int) -> int:
    """Held blocks summed over every update of 20 random workloads."""
    samples: list[int] = []

    def record(scheduler: Scheduler) -> None:
        samples.append(num_held_blocks(scheduler))

    for seed in range(20):
        run_workload(seed, DRIVERS["overlapped"], sliding_window=sliding_window, between=record)
    return sum(samples)


def test_the_window_lowers_what_the_random_workloads_hold() -> None:
    """The equalities above mean something only if blocks were released along the way."""
    assert blocks_held_over_the_workloads(20) < 0.8 * blocks_held_over_the_workloads(0)


@pytest.mark.parametrize("driver", DRIVERS)
def test_choices_fork_after_the_prompt_passed_the_window(driver: str) -> None:
    """Choice 0 prefills 79 tokens, gives back the blocks before its window, then forks: the
    choices start with those entries released and share the rest."""
    scheduler = create_scheduler(sliding_window=24, long_prefill_token_threshold=32)
    worker = FakeWorker(sample=choice_sampler, sliding_window=24)
    (request,) = create_requests(1, num_tokens=80, max_new_tokens=30, n=3)
    scheduler.add_request(request)
    events = DRIVERS[driver](scheduler, worker)
    assert {i: len(t) for i, t in tokens_of(events["req0"]).items()} == {0: 30, 1: 30, 2: 30}
    assert scheduler.get_stats().num_forked_block_refs > 0
    assert_all_free(scheduler)
