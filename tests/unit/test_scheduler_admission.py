"""The admission bound: a request is refused (QueueFullError) only when the scheduler already
holds max_num_seqs + max_waiting_requests requests (running or waiting), i.e. when waiting
would exceed max_waiting_requests plus the seats still free. Factories, no gRPC."""

from __future__ import annotations

import pytest

from services.common.errors import QueueFullError
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.unit.factories import create_requests, create_scheduler, result_for


def submit_all(scheduler: Scheduler, requests: list[Request]) -> list[str]:
    """Submit each request; the ids refused with QueueFullError."""
    refused = []
    for request in requests:
        try:
            scheduler.add_request(request)
        except QueueFullError:
            refused.append(request.request_id)
    return refused


@pytest.mark.parametrize(("burst", "num_refused"), [(300, 0), (384, 0), (385, 1), (400, 16)])
def test_a_burst_before_any_step_counts_the_free_seats(burst: int, num_refused: int) -> None:
    """Nothing admitted yet: the 128 empty seats are queue room, so only the excess over
    128 + 256 is refused, and it is the last arrivals."""
    scheduler = create_scheduler(max_num_seqs=128, max_waiting_requests=256)
    requests = create_requests(burst)
    refused = submit_all(scheduler, requests)
    assert refused == [r.request_id for r in requests[burst - num_refused :]]
    assert scheduler.get_stats().num_waiting == burst - num_refused
    scheduler.check_integrity()


def test_with_every_seat_taken_only_max_waiting_wait() -> None:
    scheduler = create_scheduler(
        max_num_seqs=128, max_waiting_requests=256, max_num_batched_tokens=2048
    )
    assert submit_all(scheduler, create_requests(128, id_prefix="run")) == []
    plan = scheduler.schedule(0.0)
    assert len(plan.new_sequences) == 128
    waiting = create_requests(257, id_prefix="wait")
    assert submit_all(scheduler, waiting) == ["wait256"]
    stats = scheduler.get_stats()
    assert (stats.num_running, stats.num_waiting) == (128, 256)


def test_admission_opens_no_room_only_a_finish_does() -> None:
    """Admitting moves a request from waiting to a seat: the count the bound looks at is
    unchanged, so a scheduler at its bound refuses until a running request finishes."""
    scheduler = create_scheduler(max_num_seqs=2, max_waiting_requests=2)
    requests = create_requests(5, max_new_tokens=1)
    assert submit_all(scheduler, requests[:4]) == []
    assert submit_all(scheduler, requests[4:]) == ["req4"]
    plan = scheduler.schedule(0.0)
    assert len(plan.new_sequences) == 2
    assert submit_all(scheduler, requests[4:]) == ["req4"]
    scheduler.update(plan, result_for(scheduler, plan), 0.0)  # both finish (max_new_tokens=1)
    assert submit_all(scheduler, requests[4:]) == []
    scheduler.check_integrity()


def test_seats_without_blocks_still_count_as_room() -> None:
    """Two seats free but no KV blocks for them: those requests wait for blocks (normal
    queueing, not overload); refusal starts only past max_waiting_requests + free seats."""
    # 20-token prompts take 2 blocks of 16: 4 blocks hold 2 running requests.
    scheduler = create_scheduler(num_blocks=4, max_num_seqs=4, max_waiting_requests=2)
    requests = create_requests(7, num_tokens=20, max_new_tokens=8)
    assert submit_all(scheduler, requests[:6]) == []
    plan = scheduler.schedule(0.0)
    assert len(plan.new_sequences) == 2
    stats = scheduler.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (2, 4, 0)
    # 4 waiting = max_waiting_requests (2) + free seats (2): the bound, not above it.
    assert submit_all(scheduler, requests[6:]) == ["req6"]
    scheduler.check_integrity()
