"""The admission bound: a request is refused (QueueFullError) only when the scheduler already
holds max_num_seqs + max_waiting_requests requests (running or waiting), i.e. when waiting
would exceed max_waiting_requests plus the seats still free; and the retry hint a refusal
carries. Factories, no worker, no gRPC server."""

from __future__ import annotations

import pytest

from services.common.grpc_server import (
    REASON_METADATA_KEY,
    RETRY_PUSHBACK_METADATA_KEY,
    refusal_metadata,
    retry_pushback_ms,
)
from services.contracts.errors import CapacityError, QueueFullError
from services.scheduler.features.retry_hint import (
    DEFAULT_RETRY_AFTER_MS,
    MAX_RETRY_AFTER_MS,
    StepTimeAverage,
    retry_after_ms,
)
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.server_config import SchedulerServerConfig
from services.scheduler.step_loop import StepLoop
from services.scheduler.worker_client import WorkerUnavailable
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


# ---- the retry hint ---------------------------------------------------------------------------


def test_steps_until_a_seat_frees_is_the_running_request_closest_to_its_limit() -> None:
    scheduler = create_scheduler(max_num_seqs=2, max_waiting_requests=1)
    short, long_ = create_requests(2, max_new_tokens=5)
    long_.sampling = type(long_.sampling)(max_new_tokens=50)
    (late,) = create_requests(1, max_new_tokens=3, id_prefix="late")
    submit_all(scheduler, [short, long_, late])
    # Nothing admitted yet: the first two seats go to `short` (prefill + 5 tokens) and `long_`.
    assert scheduler.num_steps_until_a_seat_frees() == 6
    for step in range(3):
        plan = scheduler.schedule(float(step))
        scheduler.update(plan, result_for(scheduler, plan), float(step))
    # `short` sampled 3 of its 5 tokens; `late` waits and does not count.
    assert short.num_output_tokens == 3 and late.num_output_tokens == 0
    assert scheduler.num_steps_until_a_seat_frees() == 2
    plan = scheduler.schedule(3.0)  # its 4th token is in flight (pending)
    assert scheduler.num_steps_until_a_seat_frees() == 1
    scheduler.update(plan, result_for(scheduler, plan), 3.0)
    plan = scheduler.schedule(4.0)  # the last one in flight: never less than one step
    assert scheduler.num_steps_until_a_seat_frees() == 1


def test_steps_until_a_seat_frees_counts_max_model_len() -> None:
    scheduler = create_scheduler(max_model_len=14)
    (request,) = create_requests(1, num_tokens=10, max_new_tokens=100)
    scheduler.add_request(request)
    assert scheduler.num_steps_until_a_seat_frees() == 1 + 4  # prefill + tokens 11..14


@pytest.mark.parametrize(
    ("num_steps", "step_s", "expected_ms"),
    [
        (20, 0.05, 1000),
        (3, 0.0101, 31),  # rounded up
        (0, 0.05, 50),  # at least one step
        (1, 0.0, 1),  # at least 1 ms
        (10_000, 0.05, MAX_RETRY_AFTER_MS),
        (20, None, DEFAULT_RETRY_AFTER_MS),  # no step timed yet
    ],
)
def test_retry_after_ms(num_steps: int, step_s: float | None, expected_ms: int) -> None:
    assert retry_after_ms(num_steps, step_s) == expected_ms


def test_step_time_average_follows_recent_steps() -> None:
    average = StepTimeAverage(weight=0.5)
    assert average.seconds is None
    average.observe(1.0)  # a slow prefill step
    assert average.seconds == 1.0
    for _ in range(10):
        average.observe(0.1)  # decodes
    assert average.seconds == pytest.approx(0.1, abs=0.001)


def test_a_refusal_carries_the_hint_as_grpc_retry_pushback() -> None:
    """The engine loop turns the core's steps into milliseconds with its step time; the hint
    goes out as gRPC's retry pushback beside the reason, and reads back the same."""
    loop = StepLoop(SchedulerServerConfig(max_num_seqs=1, max_waiting_requests=1))
    loop.scheduler = create_scheduler(max_num_seqs=1, max_waiting_requests=1)
    loop.connected.set()
    first, second, third = create_requests(3, max_new_tokens=20)
    loop.submit(first)
    loop.submit(second)
    with pytest.raises(QueueFullError) as no_step_yet:
        loop.submit(third)
    assert no_step_yet.value.retry_after_ms == DEFAULT_RETRY_AFTER_MS
    loop.step_time.observe(0.05)
    with pytest.raises(QueueFullError) as refused:
        loop.submit(third)
    assert refused.value.retry_after_ms == 21 * 50  # prefill + 20 tokens of `first`
    metadata = refusal_metadata(refused.value)
    assert metadata == (
        (REASON_METADATA_KEY, "queue_full"),
        (RETRY_PUSHBACK_METADATA_KEY, "1050"),
    )
    assert retry_pushback_ms(dict(metadata)) == 1050
    # No hint, no pushback; the reason alone tells the refusals apart.
    assert refusal_metadata(QueueFullError("full")) == ((REASON_METADATA_KEY, "queue_full"),)
    assert refusal_metadata(CapacityError("never fits")) == (
        (REASON_METADATA_KEY, "prompt_too_long"),
    )


@pytest.mark.parametrize("value", ["", "-1", "1.5", "soon", "١٢"])
def test_a_pushback_that_is_no_wait_is_no_hint(value: str) -> None:
    assert retry_pushback_ms({RETRY_PUSHBACK_METADATA_KEY: value}) is None
    assert retry_pushback_ms({}) is None


def test_stats_wait_for_the_step_stream() -> None:
    """Between the worker's Describe and its step stream the core exists but submit refuses:
    the stats (what routing reads) stay unanswered until the two agree."""
    loop = StepLoop(SchedulerServerConfig(max_num_seqs=1, max_waiting_requests=1))
    loop.scheduler = create_scheduler(max_num_seqs=1, max_waiting_requests=1)
    assert loop.stats() is None
    with pytest.raises(WorkerUnavailable):
        loop.submit(create_requests(1)[0])
    loop.connected.set()
    stats = loop.stats()
    assert stats is not None and stats.num_waiting == 0
