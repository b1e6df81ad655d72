"""Prefix fetch's pure parts (docs/prefix-cache.md, Prefix fetch): the tokenizer tier's hint, the
receiving scheduler's reservation and completion, the exporting scheduler's plan entries, and
the cost rule that decides between fetching and computing (no model, no gRPC)."""

from __future__ import annotations

import asyncio

import pytest

from protos.llmserve.v1 import scheduler_pb2, worker_pb2
from services.common.kv_destination_proto import kv_export_from_proto, kv_export_to_proto
from services.common.prefix_hash import prefix_block_hashes
from services.contracts.errors import ConflictError, InvalidRequestError
from services.contracts.kv_transfer import ON_DISK, KvDestination, KvExport
from services.contracts.model_description import ModelDescription
from services.contracts.step import BatchPlan, StepResult
from services.contracts.worker_description import WorkerDescription
from services.scheduler import metrics
from services.scheduler.features.kv_disk import DiskTierView
from services.scheduler.kv_export_waits import ExportWaits
from services.scheduler.kv_fetch_cost import PROBE_EVERY, FetchCost
from services.scheduler.kv_handoff import KvHandoffs, PrefixFetch, prefix_fetch
from services.scheduler.request import RequestStatus
from services.scheduler.worker_client import WorkerUnavailable
from services.scheduler.worker_convert import plan_to_proto
from services.tokenizer.routing.prefix_fetch import PrefixSource, choose_prefix_source
from services.worker.convert import plan_from_proto
from tests.unit.factories import (
    BLOCK_SIZE,
    FakeWorker,
    create_requests,
    create_scheduler,
    result_for,
    run_until_done,
)

SOURCE = "127.0.0.1:2"


# ---- the tokenizer tier's hint ---------------------------------------------------------------


def test_the_hint_names_the_biggest_holder_by_the_margin() -> None:
    addresses = ["a:1", "b:1", "c:1"]
    assert choose_prefix_source([9, 2, 5], addresses, 1, 4) == PrefixSource("a:1", 9)
    # Not enough more than the chosen one holds, or the chosen one is the biggest holder.
    assert choose_prefix_source([5, 2, 0], addresses, 1, 4) is None
    assert choose_prefix_source([9, 2, 5], addresses, 0, 1) is None
    # Ties go to the first; 0 turns fetching off.
    assert choose_prefix_source([0, 6, 6], addresses, 0, 1) == PrefixSource("b:1", 6)
    assert choose_prefix_source([9, 0, 0], addresses, 1, 0) is None


def test_the_fetch_leaves_one_prompt_token_to_compute_here() -> None:
    request = scheduler_pb2.SubmitRequest(
        prompt_token_ids=list(range(3 * BLOCK_SIZE)), prefix_source=SOURCE
    )
    request.prefix_source_blocks = 3  # the whole prompt: the last block is computed here
    assert prefix_fetch(request, BLOCK_SIZE) == PrefixFetch(SOURCE, 2 * BLOCK_SIZE)
    request.prefix_source_blocks = 1
    assert prefix_fetch(request, BLOCK_SIZE) == PrefixFetch(SOURCE, BLOCK_SIZE)
    short = scheduler_pb2.SubmitRequest(
        prompt_token_ids=list(range(BLOCK_SIZE)), prefix_source=SOURCE, prefix_source_blocks=1
    )
    assert prefix_fetch(short, BLOCK_SIZE) is None
    assert prefix_fetch(scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2]), BLOCK_SIZE) is None


# ---- the receiving scheduler --------------------------------------------------------------------


def test_a_fetch_reserves_the_prefix_then_prefills_the_rest_here() -> None:
    scheduler = create_scheduler(num_blocks=20, max_num_batched_tokens=64)
    (request,) = create_requests(1, num_tokens=5 * BLOCK_SIZE + 3, max_new_tokens=4)
    scheduler.add_request(request, prefill_scheduler=SOURCE, num_prefix_tokens=3 * BLOCK_SIZE)
    plan = scheduler.schedule(0.0)
    assert plan.num_scheduled_tokens == {} and plan.new_sequences == []
    (handoff,) = scheduler.take_handoffs()
    assert handoff.prefill_scheduler == SOURCE and handoff.first_block == 0
    assert handoff.num_prefix_tokens == 3 * BLOCK_SIZE and len(handoff.block_ids) == 3
    assert request.status is RequestStatus.RUNNING and not scheduler.has_unfinished_requests()
    scheduler.complete_remote_prefill(request.request_id, [])
    assert request.num_computed_tokens == request.num_cached_tokens == 3 * BLOCK_SIZE
    # The fetched blocks are cached here now, for the next request with that prefix.
    table = scheduler.kv.get_block_table(request.request_id)
    assert len(table) == 3 and all(scheduler.kv.pool.block_hash(b) for b in table)
    plan = scheduler.schedule(1.0)
    (seq,) = plan.new_sequences
    assert seq.num_computed_tokens == 3 * BLOCK_SIZE and seq.kv_destination is None
    assert plan.num_scheduled_tokens == {request.request_id: 2 * BLOCK_SIZE + 3}
    scheduler.update(plan, result_for(scheduler, plan), 1.0)
    assert len(request.output_token_ids) == 1


def test_a_fetch_after_blocks_cached_here_sends_only_the_rest() -> None:
    scheduler = create_scheduler(num_blocks=30)
    first, second = create_requests(
        2, num_tokens=[2 * BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 1], prefix=list(range(2 * BLOCK_SIZE))
    )
    scheduler.add_request(first)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    scheduler.add_request(second, prefill_scheduler=SOURCE, num_prefix_tokens=4 * BLOCK_SIZE)
    scheduler.schedule(1.0)
    (handoff,) = scheduler.take_handoffs()
    assert handoff.first_block == 2 and len(handoff.block_ids) == 2


def test_a_fetch_is_dropped_when_this_pool_holds_as_much() -> None:
    scheduler = create_scheduler(num_blocks=30)
    prefix = list(range(3 * BLOCK_SIZE))
    first, second = create_requests(2, num_tokens=3 * BLOCK_SIZE + 2, prefix=prefix)
    scheduler.add_request(first)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    scheduler.add_request(second, prefill_scheduler=SOURCE, num_prefix_tokens=2 * BLOCK_SIZE)
    plan = scheduler.schedule(1.0)
    assert scheduler.take_handoffs() == []
    assert plan.num_scheduled_tokens[second.request_id] == 2
    assert second.num_cached_tokens == 3 * BLOCK_SIZE


def test_a_failed_fetch_prefills_the_whole_prompt_here() -> None:
    scheduler = create_scheduler(num_blocks=20)
    (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 1, max_new_tokens=2)
    scheduler.add_request(request, prefill_scheduler=SOURCE, num_prefix_tokens=2 * BLOCK_SIZE)
    scheduler.schedule(0.0)
    scheduler.take_handoffs()
    scheduler.fall_back_to_local_prefill(request.request_id)
    plan = scheduler.schedule(1.0)
    assert plan.num_scheduled_tokens == {request.request_id: 3 * BLOCK_SIZE + 1}
    # The worker discards a late push for it: the id is dropped with this plan.
    assert request.request_id in plan.finished_request_ids
    scheduler.complete_remote_prefill(request.request_id, [])  # too late: ignored
    assert request.num_cached_tokens == 0


# ---- the exporting scheduler ------------------------------------------------------------------


def _destination(first_block: int, block_ids: list[int], salt: bytes = b"") -> KvDestination:
    return KvDestination(
        "127.0.0.1:9", first_block, block_ids, "m", "float32", BLOCK_SIZE, "", salt
    )


def test_an_export_names_the_cached_blocks_in_the_next_plan() -> None:
    scheduler = create_scheduler(num_blocks=20)
    (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 1, max_new_tokens=1)
    scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    table = list(scheduler.kv.get_block_table(request.request_id))
    scheduler.update(plan, result_for(scheduler, plan), 0.0)  # finished: its blocks stay cached
    prefix = request.prompt_token_ids[: 3 * BLOCK_SIZE]
    assert scheduler.exports.add("remote-1", prefix, _destination(1, [11, 12])) == 2
    assert scheduler.has_unfinished_requests()  # a plan is owed, though nothing runs
    plan = scheduler.schedule(1.0)
    hashes = prefix_block_hashes(prefix, BLOCK_SIZE)[1:3]
    expected = KvExport("remote-1", table[1:3], _destination(1, [11, 12]), hashes)
    assert plan.kv_exports == [expected]
    assert plan.needs_worker and plan.num_scheduled_tokens == {}
    assert not scheduler.has_unfinished_requests()


def test_an_export_names_blocks_only_the_disk_tier_keeps_by_hash() -> None:
    scheduler = create_scheduler(num_blocks=20)
    prefix = list(range(2 * BLOCK_SIZE))
    hashes = prefix_block_hashes(prefix, BLOCK_SIZE)
    scheduler.disk = scheduler.exports.disk = DiskTierView([hashes[1]])
    with pytest.raises(ConflictError, match="block 0"):  # block 0 is nowhere
        scheduler.exports.add("r", prefix, _destination(0, [1, 2]))
    scheduler.exports.add("r", prefix, _destination(1, [2]))
    (export,) = scheduler.schedule(0.0).kv_exports
    assert export.block_ids == [ON_DISK] and export.block_hashes == [hashes[1]]


def test_an_export_refuses_what_the_pool_does_not_hold() -> None:
    scheduler = create_scheduler(num_blocks=20)
    prefix = list(range(2 * BLOCK_SIZE))
    with pytest.raises(ConflictError, match="block 0"):
        scheduler.exports.add("r", prefix, _destination(0, [1, 2]))
    with pytest.raises(InvalidRequestError) as bad:
        scheduler.exports.add("r", prefix[:-1], _destination(0, [1]))
    assert bad.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as bad:
        scheduler.exports.add("r", prefix, _destination(1, [1, 2]))
    assert bad.value.field == "kv_destination.block_ids"
    assert not scheduler.exports.has_pending


def test_an_export_hashes_under_the_destination_salt() -> None:
    scheduler = create_scheduler(num_blocks=20)
    (request,) = create_requests(1, num_tokens=BLOCK_SIZE + 1, max_new_tokens=1)
    scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    prefix = request.prompt_token_ids[:BLOCK_SIZE]
    # Another tenant's salt names other blocks: none is found.
    with pytest.raises(ConflictError):
        scheduler.exports.add("r", prefix, _destination(0, [1], salt=b"tenant-b"))
    assert prefix_block_hashes(prefix, BLOCK_SIZE) != prefix_block_hashes(
        prefix, BLOCK_SIZE, b"tenant-b"
    )


def test_exports_travel_in_the_plan() -> None:
    export = KvExport("r", [4, 5], _destination(2, [7, 8], salt=b"s"))
    plan = BatchPlan(step_id=3, kv_exports=[export])
    assert plan_from_proto(plan_to_proto(plan)).kv_exports == [export]
    with pytest.raises(ValueError, match="kv_destination"):
        kv_export_from_proto(worker_pb2.KvExport(request_id="r", block_ids=[1]))
    assert kv_export_from_proto(kv_export_to_proto(export)) == export


def test_an_export_call_answers_with_its_plan_result() -> None:
    asyncio.run(_export_call_answers())


async def _export_call_answers() -> None:
    waits = ExportWaits()
    sent, refused, lost = waits.wait("a"), waits.wait("b"), waits.wait("c")
    plan = BatchPlan(
        step_id=1,
        kv_exports=[
            KvExport("a", [1], _destination(0, [2])),
            KvExport("b", [1], _destination(0, [2])),
        ],
    )
    waits.on_result(plan, StepResult(step_id=1, failed_sequences={"b": "kv transfer: no"}))
    assert sent.result() is None
    with pytest.raises(InvalidRequestError, match="no"):
        refused.result()
    waits.fail_all("worker gone")
    with pytest.raises(WorkerUnavailable):
        lost.result()


# ---- fetch or compute -----------------------------------------------------------------------


def test_fetching_is_tried_until_measured_dearer_then_probed() -> None:
    cost = FetchCost()
    assert cost.worth_fetching()
    cost.observe_step(10, 1.0)  # a decode step says nothing about prefill
    assert cost.prefill_s_per_token is None
    cost.observe_step(100, 0.1)
    assert cost.worth_fetching()  # no fetch measured yet
    cost.observe_fetch(100, 0.01)
    assert cost.worth_fetching()
    for _ in range(30):
        cost.observe_fetch(100, 1.0)
    decisions = [cost.worth_fetching() for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1]


def test_a_fetched_request_with_several_choices_forks_after_its_prefill() -> None:
    scheduler = create_scheduler(num_blocks=40)
    worker = FakeWorker()
    (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 5, max_new_tokens=3, n=3)
    scheduler.add_request(request, prefill_scheduler=SOURCE, num_prefix_tokens=3 * BLOCK_SIZE)
    plan = scheduler.schedule(0.0)
    worker.step(plan)
    (handoff,) = scheduler.take_handoffs()
    # The fetched blocks' KV lands in the worker (what the push writes), then it completes;
    # the fake worker checks every later read finds the request's own tokens there.
    for position, token in enumerate(request.prompt_token_ids[: 3 * BLOCK_SIZE]):
        worker.kv[(handoff.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE)] = token
    scheduler.complete_remote_prefill(request.request_id, [])
    events = run_until_done(scheduler, worker)
    counts: dict[int, int] = {}
    for event in [e for group in events.values() for e in group]:
        counts[event.index] = counts.get(event.index, 0) + len(event.new_token_ids)
    assert counts == {0: 3, 1: 3, 2: 3}
    assert scheduler.get_stats().num_free_blocks == 40
    hashes = prefix_block_hashes(request.prompt_token_ids, BLOCK_SIZE)
    assert all(scheduler.kv.pool.get_cached_block(h) is not None for h in hashes)


def test_a_fetch_from_a_holder_that_does_not_answer_falls_back_to_computing() -> None:
    """kv_handoff's fetch against a real (closed) address: the ExportKv call fails, the
    request prefills its whole prompt here, and the fallback is counted."""

    async def scenario() -> None:
        scheduler = create_scheduler(num_blocks=20)
        (request,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 1, max_new_tokens=2)
        scheduler.add_request(
            request, prefill_scheduler="127.0.0.1:1", num_prefix_tokens=2 * BLOCK_SIZE
        )
        scheduler.schedule(0.0)
        woken = asyncio.Event()
        handoffs = KvHandoffs("127.0.0.1:9", None, 5.0, woken.set)
        model = ModelDescription("m", 10, 64, "{}", None, None, (), False)
        description = WorkerDescription(model, block_size=BLOCK_SIZE, worker_epoch="e")
        handoffs.start(scheduler, scheduler.take_handoffs(), description, 0.0)
        await asyncio.wait_for(woken.wait(), 10)
        plan = scheduler.schedule(1.0)
        assert plan.num_scheduled_tokens == {request.request_id: 3 * BLOCK_SIZE + 1}

    fallbacks = metrics.KV_FETCHES.labels("fallback")._value.get()
    asyncio.run(scenario())
    assert metrics.KV_FETCHES.labels("fallback")._value.get() == fallbacks + 1
