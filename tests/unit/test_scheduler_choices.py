"""Requests with n > 1 choices: the prompt prefilled once, the choices forked off it sharing its
KV blocks, the partial last block copied on write, every block freed however the request ends."""

from __future__ import annotations

import random

import pytest

from services.contracts.errors import InvalidRequestError
from services.contracts.step import FinishReason, TokenEvent
from services.scheduler.features.choices import choice_request_id
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import (
    BLOCK_SIZE,
    FakeWorker,
    check_worker_in_sync,
    create_requests,
    create_scheduler,
    run_overlapped,
    run_until_done,
    worker_of,
)


def choice_sampler(request_id: str, position: int) -> int:
    """Different tokens per choice (never EOS), the same for the same choice and position."""
    return 100 + (ord(request_id[-1]) * 31 + position) % 97


def by_index(events: list[TokenEvent]) -> dict[int, list[TokenEvent]]:
    grouped: dict[int, list[TokenEvent]] = {}
    for event in events:
        grouped.setdefault(event.index, []).append(event)
    return grouped


def tokens_of(events: list[TokenEvent]) -> dict[int, list[int]]:
    return {
        index: [t for e in choice for t in e.new_token_ids]
        for index, choice in by_index(events).items()
    }


def assert_all_free(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not scheduler.choices.groups
    stats = scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prompt_is_prefilled_once_then_choices_fork_sharing_its_blocks() -> None:
    scheduler = create_scheduler()
    worker = FakeWorker(sample=choice_sampler)
    (request,) = create_requests(1, num_tokens=40, max_new_tokens=5, n=4)
    scheduler.add_request(request)

    # Step 1: choice 0 alone, the prompt up to its last token; nothing sampled.
    plan = scheduler.schedule(now=0.0)
    assert [s.request_id for s in plan.new_sequences] == ["req0"]
    assert plan.num_scheduled_tokens == {"req0": 39}
    assert not scheduler.update(plan, worker.step(plan), now=0.0)
    check_worker_in_sync(scheduler, worker)
    assert scheduler.get_stats().num_forked_block_refs == 0

    # Step 2: the fork. Every choice computes token 39 into block 2 (tokens 32..38 so far):
    # each forked choice gets a copy, choice 0 (on the worker already) keeps the original.
    plan = scheduler.schedule(now=1.0)
    children = [choice_request_id("req0", i) for i in (1, 2, 3)]
    assert [s.request_id for s in plan.new_sequences] == children
    assert all(s.num_computed_tokens == 39 for s in plan.new_sequences)
    assert plan.num_scheduled_tokens == dict.fromkeys(["req0", *children], 1)
    assert len(plan.block_copies) == 3
    assert len({src for src, _ in plan.block_copies}) == 1
    tables = [scheduler.kv.get_block_table(r) for r in ["req0", *children]]
    shared = tables[0][:2]
    assert all(table[:2] == shared for table in tables)
    assert all(scheduler.kv.pool.ref_count(b) == 4 for b in shared)
    assert len({table[2] for table in tables}) == 4  # the partial block: one each now
    assert all(scheduler.kv.pool.ref_count(table[2]) == 1 for table in tables)
    stats = scheduler.get_stats()
    assert stats.num_forked_block_refs == 3 * 2
    assert stats.num_block_copies == 3
    assert stats.num_running == 4
    assert {src for src, _ in plan.block_copies} == {tables[0][2]}
    events = scheduler.update(plan, worker.step(plan), now=1.0)
    assert sorted(e.index for e in events) == [0, 1, 2, 3]
    assert {e.request_id for e in events} == {"req0"}
    check_worker_in_sync(scheduler, worker)

    rest = run_until_done(scheduler, worker)["req0"]
    outputs = tokens_of(events + rest)
    assert sorted(outputs) == [0, 1, 2, 3]
    assert all(len(tokens) == 5 for tokens in outputs.values())
    assert len({tuple(tokens) for tokens in outputs.values()}) == 4  # each its own sampling
    finishes = [e for e in rest if e.finished]
    assert sorted(e.index for e in finishes) == [0, 1, 2, 3]
    assert [e.request_finished for e in finishes] == [False, False, False, True]
    assert all(e.finish_reason is FinishReason.LENGTH for e in finishes)
    assert_all_free(scheduler)


def test_block_aligned_prompt_forks_without_copies() -> None:
    """prompt_len - 1 fills whole blocks: the last token starts a block of each choice's own."""
    scheduler = create_scheduler()
    (request,) = create_requests(1, num_tokens=2 * BLOCK_SIZE + 1, max_new_tokens=3, n=3)
    scheduler.add_request(request)
    events = run_until_done(scheduler, FakeWorker(sample=choice_sampler))["req0"]
    assert all(len(t) == 3 for t in tokens_of(events).values())
    stats = scheduler.get_stats()
    assert stats.num_block_copies == 0
    assert stats.num_forked_block_refs == 2 * 2
    assert_all_free(scheduler)


def test_seeds_follow_the_choice_index() -> None:
    scheduler = create_scheduler()
    (request,) = create_requests(1, num_tokens=20, max_new_tokens=2, n=3, seed=41)
    scheduler.add_request(request)
    seeds = {}
    worker = worker_of(scheduler)
    for step in range(3):
        plan = scheduler.schedule(now=float(step))
        seeds.update({s.request_id: s.sampling.seed for s in plan.new_sequences})
        scheduler.update(plan, worker.step(plan), now=float(step))
    assert seeds == {"req0": 41, choice_request_id("req0", 1): 42, choice_request_id("req0", 2): 43}
    run_until_done(scheduler)
    assert_all_free(scheduler)


@pytest.mark.parametrize("when", ["waiting", "prefilling", "forked"])
def test_abort_ends_every_choice_and_frees_every_block(when: str) -> None:
    scheduler = create_scheduler(long_prefill_token_threshold=16)
    (request,) = create_requests(1, num_tokens=60, max_new_tokens=50, n=4)
    scheduler.add_request(request)
    worker = worker_of(scheduler)
    num_steps = {"waiting": 0, "prefilling": 2, "forked": 6}[when]
    for step in range(num_steps):
        plan = scheduler.schedule(now=float(step))
        scheduler.update(plan, worker.step(plan), now=float(step))
        check_worker_in_sync(scheduler, worker)
    assert len(scheduler.running) == {"waiting": 0, "prefilling": 1, "forked": 4}[when]
    scheduler.abort_request("req0")
    scheduler.check_integrity()
    stats = scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # at once, before the next step
    plan = scheduler.schedule(now=10.0)
    assert sorted(plan.finished_request_ids) == sorted(
        worker.token_ids
    )  # the worker drops them all
    events = scheduler.update(plan, worker.step(plan), now=10.0)
    assert sorted(e.index for e in events) == [0, 1, 2, 3]
    assert all(e.finish_reason is FinishReason.ABORT for e in events)
    assert [e.request_finished for e in events] == [False, False, False, True]
    assert not worker.token_ids
    assert_all_free(scheduler)


def test_deadline_ends_every_choice() -> None:
    scheduler = create_scheduler()
    (request,) = create_requests(1, num_tokens=30, max_new_tokens=100, n=3, deadline=5.0)
    scheduler.add_request(request)
    events = run_until_done(scheduler)["req0"]
    finishes = [e for e in events if e.finished]
    assert sorted(e.index for e in finishes) == [0, 1, 2]
    assert all(e.finish_reason is FinishReason.DEADLINE for e in finishes)
    assert finishes[-1].request_finished
    assert_all_free(scheduler)


def test_preempted_choice_is_recomputed_alone_and_finishes() -> None:
    # 40-token prompt, 4 choices of 40 tokens: 2 shared blocks + 3 own each = 14 > 10 blocks.
    scheduler = create_scheduler(num_blocks=10)
    worker = FakeWorker(sample=choice_sampler)
    (request,) = create_requests(1, num_tokens=40, max_new_tokens=40, n=4)
    scheduler.add_request(request)
    events = run_until_done(scheduler, worker)["req0"]
    assert scheduler.get_stats().num_preemptions > 0
    outputs = tokens_of(events)
    assert sorted(outputs) == [0, 1, 2, 3]
    assert all(len(tokens) == 40 for tokens in outputs.values())
    # A resumed choice samples what it would have sampled unpreempted (its own positions).
    for index, tokens in outputs.items():
        request_id = "req0" if index == 0 else choice_request_id("req0", index)
        assert tokens == [choice_sampler(request_id, 40 + i) for i in range(40)]
    assert_all_free(scheduler)


def test_choices_of_a_prefix_cache_hit_share_the_cached_blocks() -> None:
    scheduler = create_scheduler()
    prefix = list(range(10, 10 + 2 * BLOCK_SIZE))
    (warm,) = create_requests(1, num_tokens=40, max_new_tokens=2, prefix=prefix, id_prefix="w")
    scheduler.add_request(warm)
    run_until_done(scheduler)
    (request,) = create_requests(1, num_tokens=40, max_new_tokens=4, prefix=prefix, n=4)
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    assert plan.num_scheduled_tokens == {"req0": 40 - 1 - 2 * BLOCK_SIZE}
    assert plan.new_sequences[0].num_computed_tokens == 2 * BLOCK_SIZE
    assert not scheduler.update(plan, worker_of(scheduler).step(plan), now=0.0)
    events = run_until_done(scheduler)["req0"]
    assert all(e.num_cached_tokens == 2 * BLOCK_SIZE for e in events)
    assert all(len(t) == 4 for t in tokens_of(events).values())
    assert scheduler.get_stats().num_forked_block_refs == 3 * 2
    assert_all_free(scheduler)


def test_cache_hit_up_to_the_last_token_queues_the_choices_behind() -> None:
    """Nothing left to prefill before the last token: the choices are admitted one by one,
    each taking the cached blocks by its own prefix hit."""
    scheduler = create_scheduler()
    prefix = list(range(10, 10 + 2 * BLOCK_SIZE))
    num_tokens = 2 * BLOCK_SIZE + 1
    (warm,) = create_requests(
        1, num_tokens=num_tokens, max_new_tokens=2, prefix=prefix, id_prefix="w"
    )
    scheduler.add_request(warm)
    run_until_done(scheduler)
    (request,) = create_requests(1, num_tokens=num_tokens, max_new_tokens=3, prefix=prefix, n=3)
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    assert len(plan.new_sequences) == 3
    assert all(s.num_computed_tokens == 2 * BLOCK_SIZE for s in plan.new_sequences)
    shared = scheduler.kv.get_block_table("req0")[:2]
    assert all(scheduler.kv.pool.ref_count(b) == 3 for b in shared)
    events = scheduler.update(plan, worker_of(scheduler).step(plan), now=0.0)
    events += run_until_done(scheduler)["req0"]
    assert all(len(t) == 3 for t in tokens_of(events).values())
    assert_all_free(scheduler)


def test_one_token_prompt() -> None:
    scheduler = create_scheduler()
    (request,) = create_requests(1, num_tokens=1, max_new_tokens=3, n=2)
    scheduler.add_request(request)
    events = run_until_done(scheduler)["req0"]
    assert {i: len(t) for i, t in tokens_of(events).items()} == {0: 3, 1: 3}
    assert_all_free(scheduler)


def test_seats_are_held_for_the_fork() -> None:
    """Two requests that each need 3 of 4 seats: the second waits for the first, no stall."""
    scheduler = create_scheduler(max_num_seqs=4)
    for request in create_requests(2, num_tokens=20, max_new_tokens=4, n=3):
        scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    assert list(plan.num_scheduled_tokens) == ["req0"]
    assert not scheduler.update(plan, worker_of(scheduler).step(plan), now=0.0)
    events = run_until_done(scheduler)
    assert {rid: sorted(tokens_of(ev)) for rid, ev in events.items()} == {
        "req0": [0, 1, 2],
        "req1": [0, 1, 2],
    }
    assert_all_free(scheduler)


def test_n_over_the_seats_is_refused_naming_n() -> None:
    scheduler = create_scheduler(max_num_seqs=4)
    (request,) = create_requests(1, n=5)
    with pytest.raises(InvalidRequestError) as excinfo:
        scheduler.add_request(request)
    assert excinfo.value.field == "n"


def test_max_length_policy_reserves_per_choice() -> None:
    scheduler = create_scheduler(allocation_policy="max_length")
    (request,) = create_requests(1, num_tokens=40, max_new_tokens=6, n=3)
    scheduler.add_request(request)
    events = run_until_done(scheduler)["req0"]
    assert all(len(t) == 6 for t in tokens_of(events).values())
    assert scheduler.get_stats().num_forked_block_refs == 0
    assert_all_free(scheduler)


def test_overlapped_scheduling_with_choices() -> None:
    scheduler = create_scheduler(long_prefill_token_threshold=16)
    worker = FakeWorker(sample=choice_sampler)
    for request in create_requests(3, num_tokens=[50, 17, 33], max_new_tokens=7, n=3):
        scheduler.add_request(request)
    events = run_overlapped(scheduler, worker)
    for request_id in ("req0", "req1", "req2"):
        outputs = tokens_of(events[request_id])
        assert {i: len(t) for i, t in outputs.items()} == {0: 7, 1: 7, 2: 7}
    assert_all_free(scheduler)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_choices_keeps_integrity(seed: int) -> None:
    rng = random.Random(seed)
    scheduler = create_scheduler(
        num_blocks=rng.randint(24, 60),
        max_num_seqs=rng.randint(4, 12),
        max_num_batched_tokens=rng.choice([32, 64, 512]),
        long_prefill_token_threshold=rng.choice([0, 16]),
    )
    worker = FakeWorker(sample=choice_sampler)
    expected: dict[str, tuple[int, int]] = {}
    for i in range(rng.randint(3, 10)):
        n = rng.randint(1, 4)
        max_new = rng.randint(1, 20)
        (request,) = create_requests(
            1, num_tokens=rng.randint(1, 70), max_new_tokens=max_new, n=n, id_prefix=f"r{i}-"
        )
        request.arrival_time = float(i)
        scheduler.add_request(request)
        expected[request.request_id] = (n, max_new)
    aborted = f"r{rng.randrange(len(expected))}-0"

    def maybe_abort(step: int) -> None:
        if step == 5:
            scheduler.abort_request(aborted)

    events = run_until_done(scheduler, worker, between=maybe_abort)
    for request_id, (n, max_new) in expected.items():
        finishes = [e for e in events[request_id] if e.finished]
        assert sorted(e.index for e in finishes) == list(range(n))
        assert finishes[-1].request_finished and not any(e.request_finished for e in finishes[:-1])
        if request_id != aborted:
            assert all(len(t) == max_new for t in tokens_of(events[request_id]).values())
    assert_all_free(scheduler)


def test_one_choice_can_end_while_the_others_go_on() -> None:
    scheduler = create_scheduler()
    worker = FakeWorker(sample=choice_sampler)
    (request,) = create_requests(1, num_tokens=40, max_new_tokens=10, n=3)
    scheduler.add_request(request)
    events: list[TokenEvent] = []
    for step in range(4):
        plan = scheduler.schedule(now=float(step))
        events += scheduler.update(plan, worker.step(plan), now=float(step))
    held = scheduler.get_stats().num_total_blocks - scheduler.get_stats().num_free_blocks
    scheduler.abort_choice("req0", 1)
    scheduler.abort_choice("req0", 1)  # twice: ignored
    scheduler.abort_choice("unknown", 0)
    scheduler.check_integrity()
    stats = scheduler.get_stats()
    assert stats.num_total_blocks - stats.num_free_blocks < held  # its own blocks, at once
    assert stats.num_running == 2
    events += run_until_done(scheduler, worker)["req0"]
    finishes = [e for e in events if e.finished]
    assert [(e.index, e.finish_reason) for e in finishes] == [
        (1, FinishReason.ABORT),
        (0, FinishReason.LENGTH),
        (2, FinishReason.LENGTH),
    ]
    assert finishes[-1].request_finished and not finishes[0].request_finished
    assert {i: len(t) for i, t in tokens_of(events).items()} == {0: 10, 1: 3, 2: 10}
    assert_all_free(scheduler)
