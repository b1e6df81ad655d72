"""Remote prefills in the scheduler core (features/disaggregation.py): reservation bookkeeping on
the decode side, the KV destination on the prefill side (no model, no gRPC)."""

from __future__ import annotations

from protos.llmserve.v1 import sampling_pb2, scheduler_pb2
from services.contracts.kv_transfer import KvDestination
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason
from services.scheduler.kv_handoff import disaggregates, prefill_call
from services.scheduler.request import RequestStatus
from services.scheduler.server_config import SchedulerServerConfig
from services.scheduler.step_loop import StepLoop
from tests.unit.factories import BLOCK_SIZE, create_requests, create_scheduler, result_for

PREFILL = "127.0.0.1:1"


def test_a_remote_prefill_reserves_the_whole_prompt_and_schedules_nothing() -> None:
    scheduler = create_scheduler(num_blocks=20, max_num_batched_tokens=32)
    (request,) = create_requests(1, num_tokens=5 * BLOCK_SIZE + 3, max_new_tokens=4)
    scheduler.add_request(request, prefill_scheduler=PREFILL)
    plan = scheduler.schedule(0.0)
    # Past the step's budget: nothing of it is computed here.
    assert plan.num_scheduled_tokens == {} and plan.new_sequences == []
    assert scheduler.kv.num_free_blocks == 20 - 6
    (handoff,) = scheduler.take_handoffs()
    assert handoff.prefill_scheduler == PREFILL and handoff.first_block == 0
    assert handoff.block_ids == scheduler.kv.get_block_table(request.request_id)
    assert scheduler.take_handoffs() == []
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 0
    # Awaiting its KV it is no work for the loop, and stays out of the next plans.
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule(1.0).num_scheduled_tokens == {}


def test_the_first_token_completes_it_and_it_decodes_from_the_prompt_end() -> None:
    scheduler = create_scheduler(num_blocks=20)
    (request,) = create_requests(1, num_tokens=2 * BLOCK_SIZE, max_new_tokens=3)
    scheduler.add_request(request, prefill_scheduler=PREFILL)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    scheduler.take_handoffs()
    scheduler.complete_remote_prefill(request.request_id, [77])
    assert request.num_computed_tokens == 2 * BLOCK_SIZE and request.output_token_ids == [77]
    plan = scheduler.schedule(1.0)
    (seq,) = plan.new_sequences
    assert seq.num_computed_tokens == 2 * BLOCK_SIZE and seq.token_ids[-1] == 77
    assert plan.num_scheduled_tokens == {request.request_id: 1}
    events = scheduler.update(plan, result_for(scheduler, plan), 1.0)
    # The first token goes out with this update, before the token this step sampled.
    assert events[0].new_token_ids == [77]
    assert len(request.output_token_ids) == 2


def test_a_first_token_that_ends_it_frees_its_blocks() -> None:
    scheduler = create_scheduler(num_blocks=20)
    (request,) = create_requests(1, num_tokens=20, max_new_tokens=1)
    scheduler.add_request(request, prefill_scheduler=PREFILL)
    scheduler.schedule(0.0)
    scheduler.complete_remote_prefill(request.request_id, [77])
    plan = scheduler.schedule(1.0)
    events = scheduler.update(plan, result_for(scheduler, plan), 1.0)
    assert [(e.new_token_ids, e.finish_reason) for e in events] == [([77], FinishReason.LENGTH)]
    assert scheduler.kv.num_free_blocks == 20 and not scheduler.requests


def test_fallback_prefills_locally_in_the_reserved_blocks() -> None:
    scheduler = create_scheduler(num_blocks=20, max_num_batched_tokens=16)
    (request,) = create_requests(1, num_tokens=40, max_new_tokens=2)
    scheduler.add_request(request, prefill_scheduler=PREFILL)
    scheduler.schedule(0.0)
    reserved = list(scheduler.kv.get_block_table(request.request_id))
    scheduler.fall_back_to_local_prefill(request.request_id)
    plan = scheduler.schedule(1.0)
    (seq,) = plan.new_sequences
    assert seq.block_ids == reserved and seq.num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {request.request_id: 16}  # chunked, as any prefill
    # Its worker hears of the given-up transfer (a late push must write nothing) before the
    # sequence arrives.
    assert plan.finished_request_ids == [request.request_id]
    # A late answer from the prefill pair is ignored.
    scheduler.complete_remote_prefill(request.request_id, [77])
    assert request.output_token_ids == []


def test_an_aborted_awaiting_request_frees_its_reservation() -> None:
    scheduler = create_scheduler(num_blocks=20)
    (request,) = create_requests(1, num_tokens=40)
    scheduler.add_request(request, prefill_scheduler=PREFILL)
    scheduler.schedule(0.0)
    scheduler.abort_request(request.request_id)
    assert scheduler.kv.num_free_blocks == 20
    # The worker hears the transfer is given up in the plan that may hand the blocks on.
    assert scheduler.schedule(1.0).finished_request_ids == [request.request_id]
    scheduler.complete_remote_prefill(request.request_id, [77])  # too late: ignored
    scheduler.check_integrity()
    assert scheduler.remote.request_ids() == set()


def test_a_prefix_hit_here_leaves_its_blocks_out_of_the_handoff() -> None:
    scheduler = create_scheduler(num_blocks=40)
    (first,) = create_requests(1, num_tokens=3 * BLOCK_SIZE, max_new_tokens=1)
    scheduler.add_request(first)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    prefix = first.prompt_token_ids[: 2 * BLOCK_SIZE]
    (second,) = create_requests(1, num_tokens=3 * BLOCK_SIZE + 5, prefix=prefix, id_prefix="b")
    scheduler.add_request(second, prefill_scheduler=PREFILL)
    scheduler.schedule(1.0)
    (handoff,) = scheduler.take_handoffs()
    table = scheduler.kv.get_block_table(second.request_id)
    assert handoff.first_block == 2 and handoff.block_ids == table[2:]
    assert len(table) == 4


def test_an_awaiting_request_is_never_preempted() -> None:
    # Room for the awaiting request's 3 blocks and one decode that grows until it cannot.
    scheduler = create_scheduler(num_blocks=5)
    (decoding,) = create_requests(1, num_tokens=BLOCK_SIZE, max_new_tokens=40)
    scheduler.add_request(decoding)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    (remote,) = create_requests(1, num_tokens=3 * BLOCK_SIZE, id_prefix="r", arrival_time=1.0)
    scheduler.add_request(remote, prefill_scheduler=PREFILL)
    for step in range(1, 40):
        plan = scheduler.schedule(float(step))
        scheduler.update(plan, result_for(scheduler, plan), float(step))
        assert scheduler.remote.is_awaiting(remote)
        assert len(scheduler.kv.get_block_table(remote.request_id)) == 3
    # The decode could not grow past the reservation: it gave way, and waits for the blocks.
    assert decoding.status is RequestStatus.PREEMPTED and decoding.num_preemptions == 1


def test_a_kv_destination_travels_with_the_new_sequence() -> None:
    scheduler = create_scheduler()
    (request,) = create_requests(1, num_tokens=20, max_new_tokens=1)
    destination = KvDestination("127.0.0.1:2", 0, [5, 6], "model", "float32", BLOCK_SIZE)
    scheduler.add_request(request, kv_destination=destination)
    (seq,) = scheduler.schedule(0.0).new_sequences
    assert seq.kv_destination == destination


def test_the_prefill_call_asks_for_one_token_of_the_same_request() -> None:
    request = scheduler_pb2.SubmitRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=sampling_pb2.TokenSamplingParams(max_new_tokens=50, min_new_tokens=10),
        cache_salt=b"tenant",
        lora_name="adapter",
        prefill_scheduler=PREFILL,
    )
    call = prefill_call(request)
    assert call.prefill_scheduler == PREFILL and call.submit.prefill_scheduler == ""
    assert call.submit.sampling.max_new_tokens == 1 and call.submit.sampling.min_new_tokens == 1
    assert (call.submit.cache_salt, call.submit.lora_name) == (b"tenant", "adapter")
    assert request.sampling.max_new_tokens == 50  # the decode side's request is unchanged


def test_only_single_choice_requests_without_logprobs_prefill_elsewhere() -> None:
    assert disaggregates(SamplingParams())
    assert not disaggregates(SamplingParams(n=2))
    assert not disaggregates(SamplingParams(logprobs=1))


def test_the_kv_destination_is_the_advertised_worker_address() -> None:
    """A prefill worker pushes to the address other pairs reach this worker at: --worker by
    default, --worker-advertise-address where that is only the pod's loopback."""
    local = StepLoop(SchedulerServerConfig(worker="127.0.0.1:50070"))
    assert local.handoffs.worker_address == "127.0.0.1:50070"
    pod = StepLoop(
        SchedulerServerConfig(worker="127.0.0.1:50070", worker_advertise_address="10.1.2.3:50070")
    )
    assert pod.handoffs.worker_address == "10.1.2.3:50070"
