"""Overlapped scheduling against serial: the same scheduler driven with plan N+1 made before
result N is applied must stream exactly the tokens the serial loop streams, stop at the same
token, and free every block, through chunked prefill, preemption, prefix hits and cancels."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

import pytest

from services.contracts.step import FinishReason, TokenEvent
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import (
    EOS_TOKEN_ID,
    FakeWorker,
    create_requests,
    create_scheduler,
    run_overlapped,
    run_until_done,
)

Driver = Callable[..., dict[str, list[TokenEvent]]]
DRIVERS = {"serial": run_until_done, "overlapped": run_overlapped}


def position_sampler(eos_every: int) -> Callable[[str, int], int]:
    """A token that depends only on the request and the position (so a preempted request
    resamples what it sampled before), EOS about once in `eos_every` positions."""

    def sample(request_id: str, position: int) -> int:
        draw = zlib.crc32(f"{request_id}:{position}".encode())
        return EOS_TOKEN_ID if draw % eos_every == 0 else 100 + draw % 500

    return sample


def random_workload(seed: int) -> tuple[dict[str, object], list[tuple[int, Request]]]:
    """Scheduler settings and (arrival step, request) pairs: shared prefixes, long prompts
    (chunked), a KV pool small enough to preempt, a few stop ids and min_new_tokens."""
    rng = random.Random(seed)
    config: dict[str, object] = {
        "num_blocks": rng.choice([14, 20, 40, 400]),
        "max_num_batched_tokens": rng.choice([32, 64, 256]),
        "long_prefill_token_threshold": rng.choice([0, 16]),
        "max_num_seqs": rng.choice([4, 16]),
    }
    prefix = [rng.randrange(3, 999) for _ in range(32)]
    arrivals = []
    for index in range(rng.randrange(4, 14)):
        (request,) = create_requests(
            1,
            num_tokens=rng.randrange(33, 90),
            max_new_tokens=rng.randrange(1, 24),
            prefix=prefix if rng.random() < 0.5 else None,
            id_prefix=f"r{index}-",
            min_new_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=rng.choice([(), (123,)]),
        )
        arrivals.append((rng.choice([0, 0, rng.randrange(0, 30)]), request))
    return config, arrivals


def run_workload(
    seed: int,
    driver: Driver,
    *,
    speculative_ngram: int = 0,
    guess: Callable[[Callable[[str, int], int]], Callable[[str, int], int]] | None = None,
    sliding_window: int = 0,
    between: Callable[[Scheduler], None] = lambda scheduler: None,
) -> tuple[dict[str, list[TokenEvent]], Scheduler, FakeWorker]:
    """`guess` makes the worker's draft guesser from its sampler (speculative decoding);
    `sliding_window` is the model's on every layer; `between` runs after each update."""
    config, arrivals = random_workload(seed)
    num_blocks = int(config.pop("num_blocks"))  # type: ignore[call-overload]
    scheduler = create_scheduler(
        num_blocks=num_blocks,
        speculative_ngram=speculative_ngram,
        sliding_window=sliding_window,
        **config,
    )
    sample = position_sampler(eos_every=9)
    worker = FakeWorker(
        sample=sample,
        guess=None if guess is None else guess(sample),
        sliding_window=sliding_window,
    )

    arrivals.sort(key=lambda pair: pair[0])
    clock = 0

    def arrive(step: int) -> None:
        nonlocal clock
        between(scheduler)
        clock += 1
        while arrivals and arrivals[0][0] <= clock:
            scheduler.add_request(arrivals.pop(0)[1])

    events: dict[str, list[TokenEvent]] = {}
    while arrivals:
        clock = max(clock, arrivals[0][0])  # nothing running: the next arrival comes now
        arrive(clock)
        for request_id, stream in driver(scheduler, worker, between=arrive).items():
            events.setdefault(request_id, []).extend(stream)
    return events, scheduler, worker


def streamed(events: dict[str, list[TokenEvent]]) -> dict[str, tuple[list[int], FinishReason]]:
    out = {}
    for request_id, stream in events.items():
        finishes = [i for i, event in enumerate(stream) if event.finished]
        assert finishes == [len(stream) - 1], f"{request_id}: finish is the last event, once"
        tokens = [token for event in stream for token in event.new_token_ids]
        reason = stream[-1].finish_reason
        assert reason is not None
        out[request_id] = (tokens, reason)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_overlapped_streams_exactly_what_serial_streams(seed: int) -> None:
    serial, _, _ = run_workload(seed, run_until_done)
    overlapped, scheduler, worker = run_workload(seed, run_overlapped)
    assert streamed(overlapped) == streamed(serial)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks
    assert not worker.token_ids, "the worker was told to drop every sequence"


def test_the_random_workloads_preempt_chunk_and_hit_the_prefix_cache() -> None:
    """The equality above covers the hard paths only if the workloads take them."""
    preemptions = hits = 0
    for seed in range(40):
        _, scheduler, _ = run_workload(seed, run_overlapped)
        stats = scheduler.get_stats()
        preemptions += stats.num_preemptions
        hits += stats.prefix_hit_tokens
    assert preemptions > 0 and hits > 0


@pytest.mark.parametrize("mode", DRIVERS)
def test_a_stop_token_is_the_last_token_streamed(mode: str) -> None:
    sample = position_sampler(eos_every=5)
    scheduler = create_scheduler()
    requests = create_requests(8, num_tokens=20, max_new_tokens=40)
    for request in requests:
        scheduler.add_request(request)
    events = DRIVERS[mode](scheduler, FakeWorker(sample=sample))
    for request in requests:
        expected = []
        for position in range(20, 60):
            expected.append(sample(request.request_id, position))
            if expected[-1] == EOS_TOKEN_ID:
                break
        tokens, reason = streamed(events)[request.request_id]
        assert tokens == expected
        assert reason is (
            FinishReason.STOP if expected[-1] == EOS_TOKEN_ID else FinishReason.LENGTH
        )


def test_overlapped_worker_computes_at_most_one_token_past_a_stop() -> None:
    """The discarded token: the worker ran one step the scheduler had already planned."""
    worker = FakeWorker(sample=position_sampler(eos_every=4))
    computed: dict[str, int] = {}
    original_step = worker.step

    def step(plan):  # type: ignore[no-untyped-def]
        result = original_step(plan)
        computed.update(worker.num_computed)
        return result

    worker.step = step  # type: ignore[method-assign]
    scheduler = create_scheduler()
    requests = create_requests(6, num_tokens=20, max_new_tokens=30)
    for request in requests:
        scheduler.add_request(request)
    events = run_overlapped(scheduler, worker)
    for request in requests:
        tokens, _ = streamed(events)[request.request_id]
        # KV is computed for every streamed token but the last; one more step may have run.
        assert 20 + len(tokens) - 1 <= computed[request.request_id] <= 20 + len(tokens)


def test_max_new_tokens_is_never_exceeded_on_the_worker() -> None:
    """Lengths are known ahead: no step is planned past max_new_tokens, so nothing is wasted."""
    worker = FakeWorker(sample=lambda request_id, position: 500)
    scheduler = create_scheduler()
    for request in create_requests(5, num_tokens=17, max_new_tokens=7):
        scheduler.add_request(request)
    seen: dict[str, int] = {}
    original_step = worker.step

    def step(plan):  # type: ignore[no-untyped-def]
        result = original_step(plan)
        for request_id, tokens in worker.token_ids.items():
            seen[request_id] = max(seen.get(request_id, 0), len(tokens))
        return result

    worker.step = step  # type: ignore[method-assign]
    events = run_overlapped(scheduler, worker)
    assert all(len(streamed(events)[rid][0]) == 7 for rid in events)
    assert set(seen.values()) == {17 + 7}


def test_a_thousand_random_cancels_leave_no_block_behind() -> None:
    rng = random.Random(1234)
    scheduler = create_scheduler(num_blocks=60, max_num_batched_tokens=128)
    worker = FakeWorker(sample=position_sampler(eos_every=50))
    prefix = [rng.randrange(3, 999) for _ in range(32)]
    pending = create_requests(
        1600,
        num_tokens=[rng.randrange(33, 100) for _ in range(1600)],
        max_new_tokens=30,
        prefix=prefix,
    )
    cancelled = 0

    def churn(step: int) -> None:
        nonlocal cancelled
        for _ in range(rng.randrange(0, 4)):
            if pending and len(scheduler.waiting) < 8:
                scheduler.add_request(pending.pop())
        live = list(scheduler.requests)
        for request_id in rng.sample(live, k=min(len(live), rng.randrange(0, 3))):
            scheduler.abort_request(request_id)
            cancelled += 1
        scheduler.check_integrity()

    scheduler.add_request(pending.pop())
    while pending or scheduler.has_unfinished_requests():
        run_overlapped(scheduler, worker, between=churn)
        if pending:
            scheduler.add_request(pending.pop())
    assert cancelled >= 1000
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks
    assert not scheduler.requests and not worker.token_ids
    scheduler.check_integrity()


def test_a_plan_needs_the_worker_only_with_work_for_it() -> None:
    from services.contracts.step import BatchPlan

    assert not BatchPlan(step_id=0).needs_worker
    assert BatchPlan(step_id=0, finished_request_ids=["a"]).needs_worker
    assert BatchPlan(step_id=0, block_copies=[(1, 2)]).needs_worker
    assert BatchPlan(step_id=0, num_scheduled_tokens={"a": 1}).needs_worker
