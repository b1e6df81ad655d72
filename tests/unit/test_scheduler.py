"""Scheduler behaviour with hand-built worker results (no model, no gRPC)."""

from __future__ import annotations

import random

import pytest

from services.contracts.errors import CapacityError, QueueFullError
from services.contracts.step import FinishReason, StepResult
from services.scheduler.request import RequestStatus
from tests.unit.factories import (
    EOS_TOKEN_ID,
    FakeWorker,
    create_requests,
    create_scheduler,
    result_for,
    run_until_done,
)


def test_empty_schedule_still_advances_step_id() -> None:
    scheduler = create_scheduler()
    first, second = scheduler.schedule(0.0), scheduler.schedule(1.0)
    assert first.is_empty and second.is_empty
    assert (first.step_id, second.step_id) == (0, 1)
    assert not scheduler.has_unfinished_requests()


def test_new_sequence_is_sent_once_then_only_deltas() -> None:
    scheduler = create_scheduler()
    (request,) = create_requests(1, num_tokens=15, max_new_tokens=10)
    scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    (seq,) = plan.new_sequences
    assert seq.token_ids == request.prompt_token_ids and seq.num_prompt_tokens == 15
    assert len(seq.block_ids) == 1 and plan.num_scheduled_tokens == {"req0": 15}
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    # Token 16 still fits the first block: no delta. Token 17 needs a second block.
    plan = scheduler.schedule(1.0)
    assert plan.new_sequences == [] and plan.block_deltas == []
    assert plan.num_scheduled_tokens == {"req0": 1}
    scheduler.update(plan, result_for(scheduler, plan), 1.0)
    plan = scheduler.schedule(2.0)
    assert [(d.request_id, len(d.new_block_ids)) for d in plan.block_deltas] == [("req0", 1)]


def test_fcfs_admission_under_max_num_seqs() -> None:
    scheduler = create_scheduler(max_num_seqs=2)
    for request in create_requests(3, num_tokens=8, max_new_tokens=2):
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    assert list(plan.num_scheduled_tokens) == ["req0", "req1"]
    events = scheduler.update(plan, result_for(scheduler, plan), 0.0)
    assert [e.request_id for e in events] == ["req0", "req1"]
    plan = scheduler.schedule(1.0)  # both decode their second and last token
    scheduler.update(plan, result_for(scheduler, plan), 1.0)
    plan = scheduler.schedule(2.0)
    assert plan.finished_request_ids == ["req0", "req1"]
    assert [s.request_id for s in plan.new_sequences] == ["req2"]


def test_chunked_prefill_shares_steps_with_decodes() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=64)
    short = create_requests(2, num_tokens=10, max_new_tokens=50)
    for request in short:
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)

    (long,) = create_requests(1, num_tokens=200, id_prefix="long", arrival_time=5.0)
    scheduler.add_request(long)
    chunks = []
    for step in range(1, 5):
        plan = scheduler.schedule(float(step))
        assert plan.num_scheduled_tokens["req0"] == 1 and plan.num_scheduled_tokens["req1"] == 1
        assert plan.total_num_scheduled_tokens <= 64
        chunks.append(plan.num_scheduled_tokens["long0"])
        result = result_for(scheduler, plan)
        assert ("long0" in result.sampled_token_ids) == (sum(chunks) == 200)
        events = scheduler.update(plan, result, float(step))
        assert ("long0" in [e.request_id for e in events]) == (sum(chunks) == 200)
    assert chunks == [62, 62, 62, 14]
    assert long.output_token_ids == [7]


def test_long_prefill_threshold_caps_a_chunk() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=20)
    for request in create_requests(2, num_tokens=50):
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    assert plan.num_scheduled_tokens == {"req0": 20, "req1": 20}


def test_budget_and_max_num_seqs_hold_on_a_busy_workload() -> None:
    scheduler = create_scheduler(max_num_seqs=5, max_num_batched_tokens=40, num_blocks=200)
    rng = random.Random(0)
    lengths = [rng.randint(1, 90) for _ in range(30)]
    for request in create_requests(30, num_tokens=lengths, max_new_tokens=5):
        scheduler.add_request(request)
    worker = FakeWorker()
    steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule(float(steps))
        assert plan.total_num_scheduled_tokens <= 40
        assert len(plan.num_scheduled_tokens) <= 5
        scheduler.update(plan, worker.step(plan), float(steps))
        scheduler.check_integrity()
        steps += 1
    assert scheduler.get_stats().num_free_blocks == 200


def test_watermark_blocks_admission() -> None:
    # 80 + 15 blocks fit in 100, but not with 10 blocks of headroom.
    for watermark, admitted in ((0.1, ["req0"]), (0.0, ["req0", "req1"])):
        scheduler = create_scheduler(
            num_blocks=100, watermark=watermark, max_num_batched_tokens=4096, max_model_len=4096
        )
        for request in create_requests(2, num_tokens=[16 * 80, 16 * 15], max_new_tokens=1):
            scheduler.add_request(request)
        plan = scheduler.schedule(0.0)
        assert [s.request_id for s in plan.new_sequences] == admitted


def test_preempted_request_is_recomputed_and_finishes_with_all_its_tokens() -> None:
    # 4 blocks of 16: two requests of 16 + 40 tokens cannot both hold 4 blocks.
    scheduler = create_scheduler(num_blocks=6, max_num_batched_tokens=64)
    for request in create_requests(2, num_tokens=16, max_new_tokens=40):
        scheduler.add_request(request)
    worker = FakeWorker(sample=lambda request_id, position: 100 + position)
    events = []
    preempting_plan = None
    for step in range(200):
        plan = scheduler.schedule(float(step))
        if "req1" in plan.finished_request_ids and preempting_plan is None:
            preempting_plan = plan
        events += scheduler.update(plan, worker.step(plan), float(step))
        scheduler.check_integrity()
        if not scheduler.has_unfinished_requests():
            break
    assert preempting_plan is not None, "the later arrival was never preempted"
    assert "req0" in preempting_plan.num_scheduled_tokens  # the earlier one kept running
    assert scheduler.get_stats().num_preemptions >= 1
    for request_id in ("req0", "req1"):
        mine = [e for e in events if e.request_id == request_id]
        tokens = [t for e in mine for t in e.new_token_ids]
        assert len(tokens) == 40 and mine[-1].finish_reason is FinishReason.LENGTH
        # The fake worker samples from the position, so a resumed request continues exactly.
        assert tokens == [100 + 16 + i for i in range(40)]


def test_resumed_request_is_resent_with_its_outputs() -> None:
    scheduler = create_scheduler(num_blocks=6, max_num_batched_tokens=64)
    for request in create_requests(2, num_tokens=16, max_new_tokens=40):
        scheduler.add_request(request)
    worker = FakeWorker()
    resent = []
    for step in range(200):
        plan = scheduler.schedule(float(step))
        resent += [s for s in plan.new_sequences if step > 0]
        scheduler.update(plan, worker.step(plan), float(step))
        if not scheduler.has_unfinished_requests():
            break
    assert resent, "nothing was preempted and resumed"
    seq = resent[0]
    assert seq.num_prompt_tokens == 16 and len(seq.token_ids) > 16
    assert seq.token_ids[16:] == [7] * (len(seq.token_ids) - 16)


def test_prefix_cache_hit_shares_blocks() -> None:
    scheduler = create_scheduler()
    prefix = list(range(500, 532))  # two full blocks
    first, second = create_requests(2, num_tokens=40, prefix=prefix, max_new_tokens=4)
    scheduler.add_request(first)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    scheduler.add_request(second)
    plan = scheduler.schedule(1.0)
    (seq,) = plan.new_sequences
    first_table = scheduler.kv.get_block_table("req0")
    assert seq.num_computed_tokens == 32 and plan.num_scheduled_tokens["req1"] == 8
    assert seq.block_ids[:2] == first_table[:2] and seq.block_ids[2] != first_table[2]
    assert [scheduler.kv.pool.ref_count(b) for b in first_table[:2]] == [2, 2]
    stats = scheduler.get_stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (80, 32)
    assert stats.prefix_hit_rate == pytest.approx(0.4)
    events = scheduler.update(plan, result_for(scheduler, plan), 1.0)
    assert {e.request_id: e.num_cached_tokens for e in events} == {"req0": 0, "req1": 32}


def test_abort_frees_blocks_at_once_and_reports_next_step() -> None:
    scheduler = create_scheduler(num_blocks=50)
    running, waiting = create_requests(2, num_tokens=40)
    scheduler.add_request(running)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    scheduler.add_request(waiting)
    assert scheduler.get_stats().num_free_blocks == 47
    scheduler.abort_request("req0")
    scheduler.abort_request("req1")
    scheduler.abort_request("req0")  # idempotent
    scheduler.abort_request("nobody")  # unknown ids are ignored
    assert scheduler.get_stats().num_free_blocks == 50
    assert scheduler.has_unfinished_requests()  # the abort events are still owed
    plan = scheduler.schedule(1.0)
    assert plan.finished_request_ids == ["req0"]  # req1 never reached the worker
    assert plan.is_empty
    events = scheduler.update(plan, StepResult(plan.step_id), 1.0)
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("req0", FinishReason.ABORT),
        ("req1", FinishReason.ABORT),
    ]
    assert not scheduler.has_unfinished_requests()
    scheduler.check_integrity()


def test_abort_between_schedule_and_update_drops_the_sampled_token() -> None:
    scheduler = create_scheduler()
    (request,) = create_requests(1)
    scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    result = result_for(scheduler, plan)
    scheduler.abort_request("req0")
    events = scheduler.update(plan, result, 0.0)
    assert [(e.new_token_ids, e.finish_reason) for e in events] == [([], FinishReason.ABORT)]
    assert request.output_token_ids == []
    assert scheduler.schedule(1.0).finished_request_ids == ["req0"]


def test_deadline_expires_while_waiting_and_while_running() -> None:
    scheduler = create_scheduler(max_num_seqs=1)
    running, waiting = create_requests(2, num_tokens=8, max_new_tokens=100)
    running.deadline, waiting.deadline = 10.0, 5.0
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)

    plan = scheduler.schedule(5.0)  # the waiting one expires, never having run
    assert plan.finished_request_ids == [] and list(plan.num_scheduled_tokens) == ["req0"]
    events = scheduler.update(plan, result_for(scheduler, plan), 5.0)
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("req1", FinishReason.DEADLINE),
        ("req0", None),
    ]
    plan = scheduler.schedule(10.0)  # now the running one
    assert plan.finished_request_ids == ["req0"] and plan.is_empty
    assert scheduler.get_stats().num_free_blocks == 1000
    events = scheduler.update(plan, StepResult(plan.step_id), 10.0)
    assert [(e.request_id, e.finish_reason) for e in events] == [("req0", FinishReason.DEADLINE)]
    assert running.status is RequestStatus.FINISHED


def test_queue_full_and_capacity_errors() -> None:
    # One seat and one place in the queue behind it: two requests (tests/unit/
    # test_scheduler_admission.py has the bound itself).
    scheduler = create_scheduler(
        max_num_seqs=1, max_waiting_requests=1, num_blocks=4, max_model_len=100
    )
    first, second, third = create_requests(3)
    scheduler.add_request(first)
    scheduler.add_request(second)
    with pytest.raises(QueueFullError):
        scheduler.add_request(third)
    (too_long,) = create_requests(1, num_tokens=100, id_prefix="long")
    with pytest.raises(CapacityError):
        scheduler.add_request(too_long)  # prompt + 1 > max_model_len
    (too_big,) = create_requests(1, num_tokens=64, id_prefix="big")
    with pytest.raises(CapacityError):
        scheduler.add_request(too_big)  # 65 tokens need 5 blocks of 16; 4 exist
    assert scheduler.get_stats().num_waiting == 2


def test_stop_conditions() -> None:
    scheduler = create_scheduler(max_model_len=14)
    stop_eos, ignore_eos, stop_id, min_new, long_ = create_requests(5, num_tokens=10)
    ignore_eos.sampling = type(ignore_eos.sampling)(max_new_tokens=16, ignore_eos=True)
    stop_id.sampling = type(stop_id.sampling)(max_new_tokens=16, stop_token_ids=(42,))
    min_new.sampling = type(min_new.sampling)(max_new_tokens=16, min_new_tokens=1)
    for request in (stop_eos, ignore_eos, stop_id, min_new, long_):
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    tokens = {"req0": EOS_TOKEN_ID, "req1": EOS_TOKEN_ID, "req2": 42, "req3": EOS_TOKEN_ID}
    events = scheduler.update(plan, result_for(scheduler, plan, tokens), 0.0)
    reasons = {e.request_id: e.finish_reason for e in events}
    assert reasons == {
        "req0": FinishReason.STOP,
        "req1": None,
        "req2": FinishReason.STOP,
        "req3": None,  # EOS inside min_new_tokens does not stop
        "req4": None,
    }
    events = []
    for step in range(1, 4):  # 10 prompt + 4 outputs = max_model_len 14
        plan = scheduler.schedule(float(step))
        events += scheduler.update(plan, result_for(scheduler, plan), float(step))
    assert {e.request_id: e.finish_reason for e in events if e.finished} == {
        "req1": FinishReason.LENGTH,
        "req3": FinishReason.LENGTH,
        "req4": FinishReason.LENGTH,
    }
    assert long_.num_tokens == 14


def test_max_new_tokens_ends_with_length() -> None:
    scheduler = create_scheduler()
    for request in create_requests(3, num_tokens=[5, 17, 33], max_new_tokens=3):
        scheduler.add_request(request)
    events = run_until_done(scheduler)
    for request_events in events.values():
        assert sum(len(e.new_token_ids) for e in request_events) == 3
        assert request_events[-1].finish_reason is FinishReason.LENGTH
        assert all(not e.finished for e in request_events[:-1])


def test_max_length_policy_admits_fewer_than_paged() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(10, 200) for _ in range(40)]
    admitted = {}
    for policy in ("paged", "max_length"):
        scheduler = create_scheduler(
            num_blocks=128, allocation_policy=policy, max_num_batched_tokens=8192, watermark=0.01
        )
        for request in create_requests(40, num_tokens=lengths, max_new_tokens=300):
            scheduler.add_request(request)
        plan = scheduler.schedule(0.0)
        admitted[policy] = len(plan.new_sequences)
        scheduler.check_integrity()
    assert admitted["max_length"] < admitted["paged"] // 2, admitted


def test_max_length_policy_runs_a_workload_to_completion() -> None:
    scheduler = create_scheduler(num_blocks=40, allocation_policy="max_length")
    lengths = [5, 60, 17, 100, 33, 8]
    for request in create_requests(6, num_tokens=lengths, max_new_tokens=50):
        scheduler.add_request(request)
    events = run_until_done(scheduler)
    assert all(sum(len(e.new_token_ids) for e in evs) == 50 for evs in events.values())
    assert scheduler.get_stats().num_preemptions == 0  # reservations never run out


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_integrity_and_finishes(seed: int) -> None:
    rng = random.Random(seed)
    scheduler = create_scheduler(
        num_blocks=30, max_num_seqs=6, max_num_batched_tokens=48, watermark=0.05
    )
    prefix = list(range(900, 932))
    lengths = [rng.randint(1, 120) for _ in range(25)]
    requests = create_requests(25, num_tokens=lengths, max_new_tokens=rng.randint(1, 40))
    for request in requests[:12]:
        request.prompt_token_ids[: min(32, request.num_prompt_tokens)] = prefix[
            : request.num_prompt_tokens
        ]
    for request in requests:
        scheduler.add_request(request)
    events = run_until_done(scheduler)
    assert set(events) == {r.request_id for r in requests}
    for request in requests:
        assert request.num_output_tokens == request.sampling.max_new_tokens
    stats = scheduler.get_stats()
    assert stats.num_free_blocks == 30
    assert stats.prefix_hit_tokens > 0


def test_sequence_that_outgrows_the_whole_cache_ends_with_length() -> None:
    scheduler = create_scheduler(num_blocks=4)  # 64 tokens of KV
    (request,) = create_requests(1, num_tokens=16, max_new_tokens=100)
    scheduler.add_request(request)
    events = run_until_done(scheduler)["req0"]
    assert events[-1].finish_reason is FinishReason.LENGTH
    # Tokens 0..63 had KV; the token sampled at position 64 is the last one out.
    assert request.num_tokens == 65 and scheduler.get_stats().num_preemptions == 0


def test_watermark_is_not_kept_when_nothing_runs() -> None:
    scheduler = create_scheduler(num_blocks=10, watermark=0.5)
    (request,) = create_requests(1, num_tokens=16 * 8)
    scheduler.add_request(request)  # 9 blocks with the next token: more than 10 - 5
    plan = scheduler.schedule(0.0)
    assert [s.request_id for s in plan.new_sequences] == ["req0"]


@pytest.mark.parametrize("debug_checks", [True, False])
def test_debug_checks_catch_a_disagreement_at_the_next_step(debug_checks: bool) -> None:
    """With debug_checks the step after a corruption fails naming it; without, nothing runs."""
    scheduler = create_scheduler(num_blocks=16, debug_checks=debug_checks)
    for request in create_requests(2, num_tokens=10, max_new_tokens=4):
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    scheduler.choices.num_reserved_seats += 1  # seats no running request holds
    plan = scheduler.schedule(1.0)
    if debug_checks:
        with pytest.raises(AssertionError, match=r"\(0, 1\)"):
            scheduler.update(plan, result_for(scheduler, plan), 1.0)
    else:
        scheduler.update(plan, result_for(scheduler, plan), 1.0)
