"""Fair shares between tenants: the pure rules (fair_share.py) and the scheduler core using
them, driven by the fake worker (every plan checked against the KV it reads)."""

from __future__ import annotations

from collections import Counter

import pytest

from services.contracts.errors import QueueFullError
from services.contracts.step import TokenEvent
from services.scheduler.features.fair_share import MAX_TENANTS, FairShare, Tenant
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import create_requests, create_scheduler, worker_of

TENANTS: dict[str, Tenant] = {}
"""Each request tenant_requests made, by id: the tenant it is submitted as."""


def tenant_requests(
    tenant: str, count: int, *, weight: int = 1, max_new_tokens: int = 16, start: float = 0.0
) -> list[Request]:
    requests = create_requests(
        count,
        10,
        max_new_tokens,
        id_prefix=f"{tenant}-{start:g}-",
        arrival_time=start,
        ignore_eos=True,
    )
    for request in requests:
        TENANTS[request.request_id] = Tenant(tenant, weight)
    return requests


def tenant(request: Request) -> Tenant:
    return TENANTS[request.request_id]


def note_all(fair: FairShare, requests: list[Request]) -> None:
    """As the scheduler does when it queues them."""
    for request in requests:
        fair.note(tenant(request), [])
        fair.on_queued(request.request_id, tenant(request))


def add_all(scheduler: Scheduler, requests: list[Request]) -> None:
    for request in requests:
        scheduler.add_request(request, tenant=tenant(request))


def run_steps(scheduler: Scheduler, num_steps: int, start: float = 0.0) -> list[TokenEvent]:
    worker = worker_of(scheduler)
    events: list[TokenEvent] = []
    for step in range(num_steps):
        plan = scheduler.schedule(start + step)
        events += scheduler.update(plan, worker.step(plan), start + step)
    return events


def running_by_tenant(scheduler: Scheduler) -> Counter[str]:
    return Counter(scheduler.fair.tenant_of(r) for r in scheduler.running)


def tokens_by_tenant(events: list[TokenEvent], scheduler_requests: dict[str, str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for event in events:
        counts[scheduler_requests[event.request_id]] += len(event.new_token_ids)
    return counts


# ---- the pure rules ---------------------------------------------------------------------


def test_one_tenant_is_first_come_first_served() -> None:
    fair = FairShare()
    waiting = tenant_requests("a", 3)
    note_all(fair, waiting)
    assert fair.next_to_admit(waiting, [], set()) is waiting[0]
    assert fair.next_to_admit(waiting, [], {waiting[0].request_id}) is waiting[1]
    running = tenant_requests("a", 4, start=10)
    note_all(fair, running)
    assert fair.seats_to_free(waiting, running, 4, 0) == []


def test_admission_goes_to_the_tenant_with_fewest_seats_per_weight() -> None:
    fair = FairShare()
    a_waiting, b_waiting = tenant_requests("a", 3), tenant_requests("b", 2, start=5)
    running = tenant_requests("a", 2, start=100)
    note_all(fair, [*a_waiting, *b_waiting, *running])
    # a holds 2 seats, b none: b goes first although a came first.
    assert fair.next_to_admit([*a_waiting, *b_waiting], running, set()) is b_waiting[0]
    # Equal seats: the tenant whose request is first in the queue.
    both_running = [*running, *tenant_requests("b", 2, start=200)]
    note_all(fair, both_running)
    assert fair.next_to_admit([*a_waiting, *b_waiting], both_running, set()) is a_waiting[0]


def test_weights_decide_the_order() -> None:
    fair = FairShare()
    heavy = tenant_requests("heavy", 4, weight=3)
    light = tenant_requests("light", 4, start=50)
    running = [*tenant_requests("heavy", 2, weight=3, start=100), *light[:1]]
    note_all(fair, [*heavy, *light, *running])
    # heavy: (2 + 1) / 3 = 1 seat per weight with one more; light: (1 + 1) / 1 = 2.
    assert fair.next_to_admit([*heavy, *light[1:]], running, set()) is heavy[0]


def test_seats_to_free_takes_from_the_tenant_over_its_share_only_down_to_it() -> None:
    fair = FairShare()
    running = tenant_requests("a", 8, start=100)
    waiting = tenant_requests("b", 6)
    note_all(fair, [*running, *waiting])
    victims = fair.seats_to_free(waiting, running, num_seats=8, num_free=0)
    # Shares 4 and 4: four of a's latest arrivals give way, no more although b has six.
    assert victims == running[-1:-5:-1]
    # Two free seats cover two of b's: two preemptions left.
    assert len(fair.seats_to_free(waiting, running, num_seats=8, num_free=2)) == 2
    # Only as many as b waits for.
    assert len(fair.seats_to_free(waiting[:1], running, num_seats=8, num_free=0)) == 1


def test_no_seat_swings_between_tenants_at_their_shares() -> None:
    fair = FairShare()
    running = [*tenant_requests("a", 6, start=100), *tenant_requests("b", 5, start=200)]
    running += tenant_requests("c", 5, start=300)
    waiting = tenant_requests("c", 3)
    note_all(fair, [*running, *waiting])
    # 16 seats, three equal tenants: 5.33 each. c (5) may not take a's sixth: a would drop
    # to 5, under its share, and take it back.
    assert fair.seats_to_free(waiting, running, num_seats=16, num_free=0) == []


def test_victim_under_memory_pressure_is_from_the_tenant_most_over_its_share() -> None:
    fair = FairShare()
    a = tenant_requests("a", 6, start=0)
    b = tenant_requests("b", 2, start=10)
    running = [*a[:3], *b, *a[3:]]
    note_all(fair, running)
    # Candidates after position 2: b0, b1, a3, a4, a5; a holds 6 seats for weight 1.
    assert fair.victim(running, running[3:]) is a[5]
    assert fair.victim(running, [b[0], b[1]]) is b[1]
    single = tenant_requests("a", 3)
    assert fair.victim(single, single[1:]) is single[2]


def test_queue_room_kept_for_a_tenant_under_its_share() -> None:
    fair = FairShare()
    held = tenant_requests("a", 10)
    note_all(fair, held)
    b = tenant_requests("b", 6)
    assert fair.may_exceed_bound(tenant(b[0]), held, bound=10)
    assert not fair.may_exceed_bound(Tenant("a"), held, bound=10)
    # b already holds its share (5 of 10): no more room for it.
    note_all(fair, b[:5])
    assert not fair.may_exceed_bound(tenant(b[5]), [*held, *b[:5]], bound=10)
    assert not fair.may_exceed_bound(tenant(b[0]), held * 2, bound=10)  # twice the bound: never
    assert not FairShare(enabled=False).may_exceed_bound(tenant(b[0]), held, bound=10)


# ---- the scheduler core with fair shares ------------------------------------------------


def test_a_late_tenant_gets_seats_at_once_from_a_flooding_one() -> None:
    scheduler = create_scheduler(max_num_seqs=8, max_num_batched_tokens=256)
    add_all(scheduler, tenant_requests("a", 40, max_new_tokens=64))
    run_steps(scheduler, 5)
    assert running_by_tenant(scheduler) == {"a": 8}
    add_all(scheduler, tenant_requests("b", 4, max_new_tokens=8, start=1000))
    run_steps(scheduler, 1, start=5)
    assert running_by_tenant(scheduler) == {"a": 4, "b": 4}
    assert scheduler.num_preemptions == 4


def test_without_fair_shares_a_late_tenant_waits() -> None:
    scheduler = create_scheduler(max_num_seqs=8, max_num_batched_tokens=256, fair_share=False)
    add_all(scheduler, tenant_requests("a", 40, max_new_tokens=64))
    run_steps(scheduler, 5)
    add_all(scheduler, tenant_requests("b", 4, max_new_tokens=8, start=1000))
    run_steps(scheduler, 1, start=5)
    assert running_by_tenant(scheduler) == {"a": 8}
    assert scheduler.num_preemptions == 0


@pytest.mark.parametrize(("weight_a", "weight_b"), [(1, 1), (3, 1)])
def test_saturating_tenants_split_output_tokens_by_weight(weight_a: int, weight_b: int) -> None:
    scheduler = create_scheduler(max_num_seqs=8, max_num_batched_tokens=256)
    a = tenant_requests("a", 60, weight=weight_a, max_new_tokens=24)
    b = tenant_requests("b", 60, weight=weight_b, max_new_tokens=24, start=0.5)
    owner = {r.request_id: tenant(r).tenant_id for r in (*a, *b)}
    add_all(scheduler, [r for pair in zip(a, b, strict=True) for r in pair])
    run_steps(scheduler, 20)  # both tenants still have plenty waiting after these
    events = run_steps(scheduler, 100, start=20)
    assert scheduler.waiting, "both tenants must still be saturating"
    tokens = tokens_by_tenant(events, owner)
    ratio = tokens["a"] / tokens["b"]
    expected = weight_a / weight_b
    assert abs(ratio - expected) / expected < 0.15, (tokens, ratio)


def test_the_queue_bound_keeps_room_for_another_tenant() -> None:
    scheduler = create_scheduler(max_num_seqs=4, max_waiting_requests=4)
    add_all(scheduler, tenant_requests("a", 8))
    with pytest.raises(QueueFullError):
        add_all(scheduler, tenant_requests("a", 1, start=100))
    add_all(scheduler, tenant_requests("b", 4, start=200))  # its share of the bound: 4 of 8
    with pytest.raises(QueueFullError):
        add_all(scheduler, tenant_requests("b", 5, start=300)[4:])
    run_steps(scheduler, 200)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks


def test_memory_pressure_preempts_the_tenant_over_its_share() -> None:
    # 8 blocks of 16 tokens: prompts of 10 and 40 new tokens need 4 blocks each at the end.
    scheduler = create_scheduler(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=256)
    a = tenant_requests("a", 3, max_new_tokens=40)
    b = tenant_requests("b", 1, max_new_tokens=40, start=0.5)
    add_all(scheduler, [a[0], b[0], a[1], a[2]])
    run_steps(scheduler, 200)
    assert scheduler.num_preemptions > 0
    assert b[0].num_preemptions == 0
    assert sum(r.num_preemptions for r in a) == scheduler.num_preemptions
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks


def test_idle_tenants_are_forgotten_past_the_table_size() -> None:
    fair = FairShare()
    held = tenant_requests("busy", 1, weight=5)
    note_all(fair, held)
    for index in range(MAX_TENANTS + 10):
        fair.note(Tenant(f"t{index}", weight=2), held)
    assert len(fair._weights) <= MAX_TENANTS
    assert fair.weight("busy") == 5


@pytest.mark.parametrize("enabled", [True, False])
def test_the_flag_reaches_the_scheduler_core(enabled: bool) -> None:
    from services.scheduler.server_config import SchedulerServerConfig

    config = SchedulerServerConfig(fair_share=enabled).scheduler_config(16, 2048)
    assert config.fair_share is enabled


def test_every_choice_is_of_its_requests_tenant_until_the_last_one_leaves() -> None:
    scheduler = create_scheduler(max_num_seqs=8, max_num_batched_tokens=256)
    for unnamed in create_requests(4, 10, 8, id_prefix="none-", ignore_eos=True):
        scheduler.add_request(unnamed)
    (request,) = create_requests(1, 24, 8, id_prefix="b-n3-", n=3, ignore_eos=True)
    scheduler.add_request(request, tenant=Tenant("b", 2))
    run_steps(scheduler, 3)
    assert running_by_tenant(scheduler) == {"": 4, "b": 3}
    assert scheduler.fair.request_ids() == {"b-n3-0"}  # only named tenants are kept
    run_steps(scheduler, 40, start=3)
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.fair.request_ids()
