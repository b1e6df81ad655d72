"""LoRA adapters in the scheduler core: a step never mixes more adapters than the worker has
slots (lora_admission.py), a sequence the worker cannot run fails alone and caches nothing, and
the cache salt keeps adapters' blocks apart. Driven by the fake worker, which holds each plan
to its slots (tests/unit/factories.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.prefix_hash import adapter_salt, tenant_salt
from services.contracts.errors import InvalidRequestError
from services.contracts.step import TokenEvent
from services.scheduler.features.lora_admission import LoraAdmission
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import create_requests, create_scheduler, worker_of


def adapter_requests(
    lora_name: str, count: int, *, start: float = 0.0, max_new_tokens: int = 8, prompt_len: int = 10
) -> list[Request]:
    requests = create_requests(
        count,
        prompt_len,
        max_new_tokens,
        id_prefix=f"{lora_name or 'base'}-{start:g}-",
        arrival_time=start,
        ignore_eos=True,
    )
    return [
        replace(r, lora_name=lora_name, cache_salt=adapter_salt(b"", lora_name)) for r in requests
    ]


def run_steps(scheduler: Scheduler, num_steps: int) -> list[TokenEvent]:
    worker = worker_of(scheduler)
    events: list[TokenEvent] = []
    for step in range(num_steps):
        plan = scheduler.schedule(float(step))
        events += scheduler.update(plan, worker.step(plan), float(step))
    return events


def running_adapters(scheduler: Scheduler) -> set[str]:
    return {r.lora_name for r in scheduler.running if r.lora_name}


def test_slots_admit_adapters_in_use_and_new_ones_while_slots_last() -> None:
    slots = LoraAdmission(2)
    running = adapter_requests("a", 1) + adapter_requests("", 1, start=5)
    slots.start_admission(running)
    assert slots.admits(adapter_requests("a", 1, start=10)[0])
    assert slots.admits(adapter_requests("", 1, start=10)[0])
    b = adapter_requests("b", 1, start=10)[0]
    assert slots.admits(b)
    slots.note_admitted(b)
    assert not slots.admits(adapter_requests("c", 1, start=10)[0])
    assert slots.admits(adapter_requests("b", 1, start=20)[0])
    assert LoraAdmission.in_use([*running, b]) == {"a", "b"}


def test_a_step_never_mixes_more_adapters_than_slots() -> None:
    scheduler = create_scheduler(max_loras=2, max_num_seqs=8)
    # a, b, c arrive first, then the base model and a again: c must wait for a slot, and the
    # requests behind it (base, a) are not held up by it.
    queued = [
        *adapter_requests("a", 1),
        *adapter_requests("b", 1, start=1),
        *adapter_requests("c", 1, start=2),
        *adapter_requests("", 2, start=3),
        *adapter_requests("a", 1, start=5),
    ]
    for request in queued:
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    admitted = {seq.request_id for seq in plan.new_sequences}
    assert {seq.lora_name for seq in plan.new_sequences} == {"a", "b", ""}
    assert "c-2-0" not in admitted
    assert len(admitted) == 5
    scheduler.update(plan, worker_of(scheduler).step(plan), 0.0)
    seen: list[set[str]] = []
    for step in range(1, 40):
        plan = scheduler.schedule(float(step))
        scheduler.update(plan, worker_of(scheduler).step(plan), float(step))
        seen.append(running_adapters(scheduler))
    # c ran once a and b had finished (the fake worker asserts the slots every step).
    assert any("c" in adapters for adapters in seen)
    assert all(len(adapters) <= 2 for adapters in seen)
    assert not scheduler.has_unfinished_requests()


def test_requests_of_one_adapter_share_its_slot() -> None:
    scheduler = create_scheduler(max_loras=1, max_num_seqs=8)
    for request in adapter_requests("a", 6):
        scheduler.add_request(request)
    plan = scheduler.schedule(0.0)
    assert len(plan.new_sequences) == 6
    assert {seq.lora_name for seq in plan.new_sequences} == {"a"}
    assert scheduler.get_stats().active_lora_adapters == {"a"}


def test_a_worker_without_slots_refuses_adapter_requests() -> None:
    scheduler = create_scheduler(max_loras=0)
    with pytest.raises(InvalidRequestError, match="lora_name"):
        scheduler.add_request(adapter_requests("a", 1)[0])


def test_a_sequence_the_worker_cannot_run_fails_alone_and_caches_nothing() -> None:
    scheduler = create_scheduler(max_loras=2, max_num_seqs=8)
    worker = worker_of(scheduler)
    worker.missing_loras.add("gone")
    gone = adapter_requests("gone", 1, prompt_len=40)[0]
    ok = adapter_requests("a", 1, start=1)[0]
    scheduler.add_request(gone)
    scheduler.add_request(ok)
    num_free = scheduler.kv.num_free_blocks
    events = run_steps(scheduler, 3)
    assert scheduler.failures == {gone.request_id: "lora_name: no adapter 'gone' is loaded"}
    assert gone.request_id not in scheduler.requests
    assert any(e.request_id == ok.request_id and e.new_token_ids for e in events)
    # Its prompt's blocks were never computed: the same prompt later finds no cached block.
    again = replace(
        adapter_requests("gone", 1, prompt_len=40)[0], request_id="again", lora_name="a"
    )
    scheduler.add_request(again)
    plan = scheduler.schedule(10.0)
    assert scheduler.requests["again"].num_cached_tokens == 0
    scheduler.update(plan, worker.step(plan), 10.0)
    run_steps(scheduler, 20)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == num_free


def test_every_choice_of_a_request_fails_with_it() -> None:
    scheduler = create_scheduler(max_loras=2, max_num_seqs=8)
    worker_of(scheduler).missing_loras.add("gone")
    request = adapter_requests("gone", 1)[0]
    request.sampling = replace(request.sampling, n=3)
    scheduler.add_request(request)
    run_steps(scheduler, 4)
    assert set(scheduler.failures) == {request.request_id}
    assert not scheduler.has_unfinished_requests()


def test_the_same_prompt_under_two_adapters_shares_no_blocks() -> None:
    scheduler = create_scheduler(max_loras=4, max_num_seqs=8, enable_prefix_caching=True)
    prompt = list(range(2000, 2064))  # 4 full blocks

    def request(request_id: str, lora_name: str, start: float) -> Request:
        base = adapter_requests(lora_name, 1, start=start)[0]
        return replace(base, request_id=request_id, prompt_token_ids=list(prompt))

    scheduler.add_request(request("first-a", "a", 0))
    run_steps(scheduler, 12)
    for request_id, lora_name in (("then-b", "b"), ("then-base", ""), ("then-a", "a")):
        scheduler.add_request(request(request_id, lora_name, 20))
    plan = scheduler.schedule(30.0)
    cached = {rid: scheduler.requests[rid].num_cached_tokens for rid in plan.num_scheduled_tokens}
    assert cached["then-b"] == 0
    assert cached["then-base"] == 0
    assert cached["then-a"] == 48  # its own adapter's blocks, up to the last full block


def test_adapter_salts_differ_from_each_other_from_the_base_and_from_tenants() -> None:
    salts = {
        adapter_salt(b"", ""),
        adapter_salt(b"", "a"),
        adapter_salt(b"", "b"),
        adapter_salt(tenant_salt("t"), "a"),
        tenant_salt("t"),
        adapter_salt(tenant_salt("t"), ""),
    }
    assert len(salts) == 5  # tenant_salt("t") with no adapter is tenant_salt("t")
    assert adapter_salt(b"x", "") == b"x"
