"""Speculative decoding in the scheduler, against the fake worker (which proposes drafts, writes
their KV, accepts those that match what it samples, and checks every plan): the tokens streamed
are exactly those of plain decoding, serial or overlapped, through chunked prefill, preemption,
prefix hits, stop tokens and length limits; KV reserved for drafts is freed when no longer
wanted, and every block is free at the end."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest

from services.contracts.step import FinishReason
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.server_config import SchedulerServerConfig
from tests.unit.factories import FakeWorker, create_requests, create_scheduler, run_until_done
from tests.unit.test_overlapped_scheduling import (
    DRIVERS,
    position_sampler,
    run_workload,
    streamed,
)


def guesser(sample: Callable[[str, int], int]) -> Callable[[str, int], int]:
    """Guesses the sampled token except at about one position in 4."""

    def guess(request_id: str, position: int) -> int:
        if zlib.crc32(f"g{request_id}:{position}".encode()) % 4 == 0:
            return 999_999  # a miss
        return sample(request_id, position)

    return guess


def run(seed: int, driver: str, speculative: int) -> tuple[dict, Scheduler, FakeWorker]:  # type: ignore[type-arg]
    return run_workload(seed, DRIVERS[driver], speculative_ngram=speculative, guess=guesser)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("seed", range(30))
def test_speculation_streams_exactly_what_plain_decoding_streams(seed: int, driver: str) -> None:
    plain, _, _ = run(seed, "serial", speculative=0)
    speculative, scheduler, worker = run(seed, driver, speculative=5)
    assert streamed(speculative) == streamed(plain)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks
    assert not worker.token_ids, "the worker was told to drop every sequence"


def test_the_workloads_speculate_accept_and_reject() -> None:
    """The equality above means something only if drafts were granted, accepted and
    rejected, under preemption."""
    proposed = accepted = preemptions = 0
    for seed in range(30):
        _, scheduler, _ = run(seed, "overlapped", speculative=5)
        stats = scheduler.get_stats()
        proposed += stats.num_draft_tokens_proposed
        accepted += stats.num_draft_tokens_accepted
        preemptions += stats.num_preemptions
    assert 0 < accepted < proposed
    assert preemptions > 0


def test_drafts_reserve_kv_and_the_reservation_is_freed_when_drafting_stops() -> None:
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=sample)
    scheduler = create_scheduler(num_blocks=64, speculative_ngram=8)
    (request,) = create_requests(1, num_tokens=15, max_new_tokens=200)
    scheduler.add_request(request)
    run_steps = 0
    while request.num_output_tokens < 3:  # prefill, then decodes that learn the step cost
        plan = scheduler.schedule(now=0.0)
        result = worker.step(plan)
        scheduler.observe_step(plan, result, 0.010 + 0.0001 * plan.total_num_scheduled_tokens)
        scheduler.update(plan, result, now=0.0)
        run_steps += 1
    plan = scheduler.schedule(now=0.0)
    slots = plan.draft_slots[request.request_id]
    assert slots > 0
    table = scheduler.kv.get_block_table(request.request_id)
    # The table covers the token computed this step and every draft slot after it.
    assert len(table) * 16 >= request.num_computed_tokens + slots
    result = worker.step(plan)
    scheduler.update(plan, result, now=0.0)
    assert len(result.accepted_draft_ids[request.request_id]) == slots  # all guessed right
    # The request turns speculation off (as one whose drafts never pay would be left out):
    # its reservation beyond the next token goes back to the pool, and the worker is told.
    request.sampling = type(request.sampling)(max_new_tokens=200, num_speculative_tokens=0)
    plan = scheduler.schedule(now=0.0)
    assert request.request_id not in plan.draft_slots
    worker.step(plan)
    assert len(scheduler.kv.get_block_table(request.request_id)) == -(
        -request.num_computed_tokens // 16
    )
    scheduler.check_integrity()


def test_a_stop_token_inside_the_accepted_drafts_ends_the_stream_there() -> None:
    stop_at = 40

    def sample(request_id: str, position: int) -> int:
        return 2 if position == stop_at else 100 + position  # EOS at position 40

    worker = FakeWorker(sample=sample, guess=sample)
    scheduler = create_scheduler(speculative_ngram=8)
    (request,) = create_requests(1, num_tokens=20, max_new_tokens=100)
    scheduler.add_request(request)
    events = run_until_done(scheduler, worker)
    tokens, reason = streamed(events)[request.request_id]
    assert tokens == [100 + p for p in range(20, stop_at)] + [2]
    assert reason is FinishReason.STOP
    assert scheduler.get_stats().num_draft_tokens_accepted > 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks


def test_max_new_tokens_holds_exactly_with_drafts() -> None:
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=sample)
    scheduler = create_scheduler(speculative_ngram=8)
    requests = create_requests(3, num_tokens=20, max_new_tokens=37)
    for request in requests:
        scheduler.add_request(request)
    events = run_until_done(scheduler, worker)
    for request in requests:
        tokens, reason = streamed(events)[request.request_id]
        assert len(tokens) == 37 and reason is FinishReason.LENGTH
        assert request.status is RequestStatus.FINISHED


@pytest.mark.parametrize(
    "sampling",
    [
        {"logprobs": 2},
        {"temperature": 0.7, "seed": 3},
        {"num_speculative_tokens": 0},
    ],
)
def test_requests_that_cannot_speculate_get_no_slots(sampling: dict) -> None:  # type: ignore[type-arg]
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=sample)
    scheduler = create_scheduler(speculative_ngram=8)
    (request,) = create_requests(1, num_tokens=20, max_new_tokens=30, **sampling)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule(now=0.0)
        assert not plan.draft_slots
        result = worker.step(plan)
        scheduler.observe_step(plan, result, 0.01)
        scheduler.update(plan, result, now=0.0)


def test_a_request_may_ask_for_speculation_when_the_server_default_is_off() -> None:
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=sample)
    scheduler = create_scheduler(speculative_ngram=0)
    (asking,) = create_requests(1, num_tokens=20, max_new_tokens=40, num_speculative_tokens=3)
    (plain,) = create_requests(1, num_tokens=20, max_new_tokens=40, id_prefix="plain")
    scheduler.add_request(asking)
    scheduler.add_request(plain)
    granted: dict[str, int] = {}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule(now=0.0)
        for request_id, slots in plan.draft_slots.items():
            assert slots <= 3
            granted[request_id] = granted.get(request_id, 0) + slots
        result = worker.step(plan)
        scheduler.observe_step(plan, result, 0.01 + 0.0001 * plan.total_num_scheduled_tokens)
        scheduler.update(plan, result, now=0.0)
    assert set(granted) == {asking.request_id}


def test_no_speculation_grants_nothing_even_to_a_request_that_asks() -> None:
    """--no-speculation is the baseline: it overrides the server's draft limit and a
    request's own num_speculative_tokens."""
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=sample)
    scheduler = create_scheduler(speculation=False, speculative_ngram=8)
    (asking,) = create_requests(1, num_tokens=20, max_new_tokens=40, num_speculative_tokens=3)
    (plain,) = create_requests(1, num_tokens=20, max_new_tokens=40, id_prefix="plain")
    scheduler.add_request(asking)
    scheduler.add_request(plain)
    num_steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule(now=0.0)
        assert not plan.draft_slots
        result = worker.step(plan)
        scheduler.observe_step(plan, result, 0.01 + 0.0001 * plan.total_num_scheduled_tokens)
        scheduler.update(plan, result, now=0.0)
        num_steps += 1
    # One token per step at most (no drafts): at least 40 steps for 40 tokens.
    assert num_steps >= 40
    assert scheduler.get_stats().num_draft_tokens_proposed == 0


def test_drafts_never_preempt_when_blocks_run_out() -> None:
    """A decode whose draft slots would need blocks the pool lacks gets no slots (and nobody
    is preempted for them); it decodes one token per step as without speculation."""
    sample = position_sampler(eos_every=10**9)
    worker = FakeWorker(sample=sample, guess=sample)
    # 2 blocks of 16: the 31-token prompt + its first token fill them exactly.
    scheduler = create_scheduler(num_blocks=2, speculative_ngram=8)
    (request,) = create_requests(1, num_tokens=31, max_new_tokens=1)
    scheduler.add_request(request)
    request.sampling = type(request.sampling)(max_new_tokens=100, num_speculative_tokens=8)
    plan = scheduler.schedule(now=0.0)
    result = worker.step(plan)
    scheduler.observe_step(plan, result, 0.01)
    scheduler.update(plan, result, now=0.0)
    plan = scheduler.schedule(now=0.0)  # position 31 is the last slot of block 1
    assert plan.num_scheduled_tokens == {request.request_id: 1}
    assert not plan.draft_slots
    assert scheduler.num_preemptions == 0
    scheduler.check_integrity()


@pytest.mark.parametrize(
    ("speculation", "batch_invariant", "limit"),
    [
        (None, True, 3),  # unset: on where drafts cannot change greedy output
        (None, False, 0),  # unset on float / gguf-exact weights: only requests that ask
        (True, False, 3),
        (False, True, 0),
    ],
)
def test_the_default_draft_limit_follows_the_workers_batch_invariance(
    speculation: bool | None, batch_invariant: bool, limit: int
) -> None:
    config = SchedulerServerConfig(speculation=speculation, speculative_ngram=3)
    core = config.scheduler_config(16, 2048, batch_invariant=batch_invariant)
    assert core.speculative_ngram == limit
    # A request's own num_speculative_tokens still counts unless --no-speculation.
    assert core.speculation is (speculation is not False)
