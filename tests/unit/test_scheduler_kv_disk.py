"""The scheduler's view of the worker's KV disk tier: every block it caches goes down once, in
the next plan, and the disk's changes from step results keep the view true."""

from __future__ import annotations

from services.contracts.step import FAILED_DISK_LOAD_PREFIX, StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import BLOCK_SIZE, create_requests, result_for


def disk_scheduler(hashes: list[bytes] | None) -> Scheduler:
    config = SchedulerConfig(block_size=BLOCK_SIZE, watermark=0.0, debug_checks=True)
    return Scheduler(config, 100, kv_disk_hashes=hashes)


def test_cached_blocks_are_sent_down_once_in_the_next_plan() -> None:
    scheduler = disk_scheduler([])
    (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 1, max_new_tokens=4)
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    assert plan.disk_stores == []
    scheduler.update(plan, result_for(scheduler, plan), now=0.0)
    plan = scheduler.schedule(now=0.0)
    table = scheduler.kv.get_block_table(request.request_id)
    assert [s.block_id for s in plan.disk_stores] == table[:3]
    assert [s.block_hash for s in plan.disk_stores] == scheduler.kv._block_hashes[
        request.request_id
    ][:3]
    assert plan.needs_worker
    scheduler.update(plan, result_for(scheduler, plan), now=0.0)
    assert scheduler.schedule(now=0.0).disk_stores == []


def test_blocks_the_disk_holds_are_not_sent_again() -> None:
    probe = disk_scheduler([])
    (request,) = create_requests(1, num_tokens=2 * BLOCK_SIZE + 1, max_new_tokens=4)
    probe.add_request(request)
    plan = probe.schedule(now=0.0)
    probe.update(plan, result_for(probe, plan), now=0.0)
    stored = [s.block_hash for s in probe.schedule(now=0.0).disk_stores]
    assert len(stored) == 2

    scheduler = disk_scheduler(stored[:1])  # a restarted worker's disk had the first block
    (again,) = create_requests(1, num_tokens=2 * BLOCK_SIZE + 1, max_new_tokens=4)
    scheduler.add_request(again)
    plan = scheduler.schedule(now=0.0)
    scheduler.update(plan, result_for(scheduler, plan), now=0.0)
    assert [s.block_hash for s in scheduler.schedule(now=0.0).disk_stores] == stored[1:]


def test_step_results_keep_the_view_of_the_disk() -> None:
    scheduler = disk_scheduler([b"\x01" * 32])
    assert scheduler.disk is not None
    plan = scheduler.schedule(now=0.0)
    result = StepResult(plan.step_id, disk_added=[b"\x02" * 32], disk_evicted=[b"\x01" * 32])
    scheduler.update(plan, result, now=0.0)
    assert scheduler.disk.holds(b"\x02" * 32)
    assert not scheduler.disk.holds(b"\x01" * 32)


def test_without_a_disk_tier_no_stores_are_made() -> None:
    scheduler = disk_scheduler(None)
    (request,) = create_requests(1, num_tokens=2 * BLOCK_SIZE + 1, max_new_tokens=4)
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    scheduler.update(plan, result_for(scheduler, plan), now=0.0)
    assert scheduler.disk is None
    assert scheduler.schedule(now=0.0).disk_stores == []


def stored_hashes(num_tokens: int) -> list[bytes]:
    probe = disk_scheduler([])
    (request,) = create_requests(1, num_tokens=num_tokens, max_new_tokens=4)
    probe.add_request(request)
    plan = probe.schedule(now=0.0)
    probe.update(plan, result_for(probe, plan), now=0.0)
    return [s.block_hash for s in probe.schedule(now=0.0).disk_stores]


def test_a_prefix_on_disk_counts_as_cached_and_is_loaded_before_the_prefill() -> None:
    hashes = stored_hashes(3 * BLOCK_SIZE + 5)
    scheduler = disk_scheduler(hashes[:2])  # a restarted worker: its pool is empty
    (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 5, max_new_tokens=4)
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    (new,) = plan.new_sequences
    assert new.num_computed_tokens == 2 * BLOCK_SIZE
    assert plan.num_scheduled_tokens == {request.request_id: BLOCK_SIZE + 5}
    assert plan.disk_loads == {
        request.request_id: list(zip(new.block_ids[:2], hashes[:2], strict=True))
    }
    assert request.num_cached_tokens == 2 * BLOCK_SIZE
    scheduler.update(plan, result_for(scheduler, plan), now=0.0)
    # the loaded blocks join the pool's cache; only the block the disk lacks goes down
    assert [s.block_hash for s in scheduler.schedule(now=0.0).disk_stores] == hashes[2:]


def test_another_tenants_prefix_on_disk_is_not_a_hit() -> None:
    hashes = stored_hashes(2 * BLOCK_SIZE + 1)
    scheduler = disk_scheduler(hashes)
    (request,) = create_requests(1, num_tokens=2 * BLOCK_SIZE + 1, max_new_tokens=4)
    request.cache_salt = b"tenant-b"
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    assert plan.disk_loads == {}
    assert plan.new_sequences[0].num_computed_tokens == 0


def test_a_disk_block_that_cannot_be_read_is_recomputed_not_failed() -> None:
    hashes = stored_hashes(3 * BLOCK_SIZE + 5)
    scheduler = disk_scheduler(hashes[:2])
    (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 5, max_new_tokens=4)
    scheduler.add_request(request)
    plan = scheduler.schedule(now=0.0)
    assert plan.disk_loads
    failed = StepResult(
        plan.step_id,
        failed_sequences={request.request_id: FAILED_DISK_LOAD_PREFIX + hashes[0].hex()},
        disk_evicted=[hashes[0]],  # the worker deleted the bad file
    )
    assert scheduler.update(plan, failed, now=0.0) == []
    assert request.request_id not in scheduler.failures
    plan = scheduler.schedule(now=0.0)
    assert plan.finished_request_ids == [request.request_id]  # dropped, then sent afresh
    (new,) = plan.new_sequences
    assert new.num_computed_tokens == 0
    assert plan.disk_loads == {}
    assert request.num_cached_tokens == 0
    assert scheduler.num_preemptions == 0
