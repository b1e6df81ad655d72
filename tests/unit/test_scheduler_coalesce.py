"""Coalescing a request's queued token events into Submit messages
(services/scheduler/features/coalesce.py): the pure merge, and the scheduler's Submit stream
over real gRPC against a fake step loop whose events are all queued before the reader asks (a
reader that fell behind)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from protos.llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.sampling_proto import sampling_to_proto
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason, TokenEvent, TokenLogprobs
from services.scheduler.features.coalesce import (
    QueueItem,
    merge_by_choice,
    merge_events,
    take_batch,
)
from services.scheduler.features.fair_share import NO_TENANT, Tenant
from services.scheduler.request import Request
from services.scheduler.server import SchedulerServicer
from services.scheduler.server_config import SchedulerServerConfig
from services.scheduler.step_loop import EventQueue, WorkerUnavailable

TIMEOUT_S = 10.0


def event(
    *token_ids: int,
    finish: FinishReason | None = None,
    logprobs: bool = False,
    num_cached_tokens: int = 0,
) -> TokenEvent:
    return TokenEvent(
        request_id="r",
        new_token_ids=list(token_ids),
        finish_reason=finish,
        logprobs=[TokenLogprobs(-t, [t], [float(-t)]) for t in token_ids] if logprobs else [],
        num_prompt_tokens=5,
        num_cached_tokens=num_cached_tokens,
    )


# ---- merge_events ---------------------------------------------------------------------------


def test_merge_concatenates_ids_and_logprobs_in_order() -> None:
    merged = merge_events([event(1, logprobs=True), event(2, 3, logprobs=True), event(4)])
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert [lp.top_token_ids for lp in merged.logprobs] == [[1], [2], [3]]
    assert merged.request_id == "r" and merged.finish_reason is None


def test_merge_takes_the_finish_and_counters_of_the_last() -> None:
    merged = merge_events(
        [event(1, num_cached_tokens=0), event(2, finish=FinishReason.LENGTH, num_cached_tokens=3)]
    )
    assert merged.finish_reason is FinishReason.LENGTH and merged.finished
    assert merged.num_prompt_tokens == 5 and merged.num_cached_tokens == 3


def test_merge_of_one_event_is_that_event() -> None:
    single = event(7)
    assert merge_events([single]) is single


def test_merge_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        merge_events([])


def test_merge_leaves_its_inputs_alone() -> None:
    first, second = event(1), event(2)
    merge_events([first, second])
    assert first.new_token_ids == [1] and second.new_token_ids == [2]


# ---- take_batch -----------------------------------------------------------------------------


def test_batch_takes_everything_up_to_the_finished_event() -> None:
    finished = event(3, finish=FinishReason.STOP)
    backlog: deque[QueueItem] = deque([event(1), event(2), finished, event(9)])
    assert [e.new_token_ids for e in take_batch(backlog)] == [[1], [2], [3]]
    assert list(backlog) == [event(9)]


def test_batch_stops_before_an_error_and_leaves_it() -> None:
    error = WorkerUnavailable("gone")
    backlog: deque[QueueItem] = deque([event(1), event(2), error])
    assert [e.new_token_ids for e in take_batch(backlog)] == [[1], [2]]
    assert take_batch(backlog) == []
    assert list(backlog) == [error]


def test_batch_stops_before_the_deadline_finish_and_leaves_it() -> None:
    deadline = event(finish=FinishReason.DEADLINE)
    backlog: deque[QueueItem] = deque([event(1), deadline])
    assert [e.new_token_ids for e in take_batch(backlog)] == [[1]]
    assert take_batch(backlog) == [] and list(backlog) == [deadline]


def test_batch_of_an_empty_backlog_is_empty() -> None:
    assert take_batch(deque()) == []


# ---- the Submit stream ----------------------------------------------------------------------


@dataclass
class FakeLoop:
    """The StepLoop surface the servicer uses; `script` is queued at submit, all at once."""

    script: Sequence[QueueItem]
    description: None = None
    aborted: list[str] = field(default_factory=list)

    def clock(self) -> float:
        return 100.0

    def submit(
        self, request: Request, *, tenant: Tenant = NO_TENANT, **disaggregation: object
    ) -> EventQueue:
        queue: EventQueue = asyncio.Queue()
        for item in self.script:
            queue.put_nowait(item)
        return queue

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def queue_seconds(self, request: Request) -> float | None:
        return 0.25


@contextlib.asynccontextmanager
async def engine_stub(loop: FakeLoop) -> AsyncIterator[scheduler_pb2_grpc.SchedulerStub]:
    server = grpc.aio.server()
    servicer = SchedulerServicer(SchedulerServerConfig(), loop, "test")  # type: ignore[arg-type]
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await server.stop(0)


def submit_request() -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling=sampling_to_proto(SamplingParams(max_new_tokens=8)),
    )


async def collect(
    loop: FakeLoop,
) -> tuple[list[scheduler_pb2.SubmitResponse], grpc.StatusCode]:
    """Every message of one Submit call, and how the call ended."""
    responses: list[scheduler_pb2.SubmitResponse] = []
    async with engine_stub(loop) as stub:
        call = stub.Submit(submit_request(), timeout=TIMEOUT_S)
        try:
            async for response in call:
                responses.append(response)
        except grpc.aio.AioRpcError as error:
            return responses, error.code()
    return responses, grpc.StatusCode.OK


def run(loop: FakeLoop) -> tuple[list[scheduler_pb2.SubmitResponse], grpc.StatusCode]:
    return asyncio.run(asyncio.wait_for(collect(loop), 30))


def test_queued_events_go_out_as_one_message() -> None:
    loop = FakeLoop(
        [event(1, logprobs=True), event(2, logprobs=True), event(3, finish=FinishReason.LENGTH)]
    )
    responses, code = run(loop)
    assert code is grpc.StatusCode.OK
    assert len(responses) == 1
    (response,) = responses
    assert list(response.token_ids) == [1, 2, 3]
    assert [lp.token_id for lp in response.logprobs] == [1, 2]
    assert response.finish_reason == "length"
    assert response.queue_ms == pytest.approx(250.0)
    assert response.num_prompt_tokens == 5
    assert "r" in loop.aborted  # the blocks are freed however the stream ends


def test_tokens_before_a_worker_failure_are_delivered_then_unavailable() -> None:
    responses, code = run(FakeLoop([event(1), event(2), WorkerUnavailable("worker gone")]))
    assert code is grpc.StatusCode.UNAVAILABLE
    assert [list(r.token_ids) for r in responses] == [[1, 2]]


def test_tokens_before_the_deadline_are_delivered_then_deadline_exceeded() -> None:
    responses, code = run(FakeLoop([event(1), event(2), event(finish=FinishReason.DEADLINE)]))
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert [list(r.token_ids) for r in responses] == [[1, 2]]


def test_a_failure_with_nothing_before_it_sends_no_message() -> None:
    responses, code = run(FakeLoop([WorkerUnavailable("worker gone")]))
    assert code is grpc.StatusCode.UNAVAILABLE and responses == []


def choice_event(index: int, *token_ids: int, unfinished: int, finish: bool = False) -> TokenEvent:
    return TokenEvent(
        request_id="r",
        new_token_ids=list(token_ids),
        finish_reason=FinishReason.LENGTH if finish else None,
        index=index,
        num_unfinished_choices=unfinished,
    )


def test_choices_merge_per_index_and_only_the_last_finish_ends_the_batch() -> None:
    backlog: deque[QueueItem] = deque(
        [
            choice_event(0, 1, unfinished=2),
            choice_event(1, 2, unfinished=2),
            choice_event(0, 3, unfinished=1, finish=True),  # choice 0 ends, choice 1 goes on
            choice_event(1, 4, unfinished=0, finish=True),
            choice_event(0, 9, unfinished=0),  # never: past the request's end
        ]
    )
    batch = take_batch(backlog)
    assert len(batch) == 4 and len(backlog) == 1
    merged = merge_by_choice(batch)
    assert [(e.index, e.new_token_ids, e.finished) for e in merged] == [
        (0, [1, 3], True),
        (1, [2, 4], True),
    ]
    assert merged[-1].request_finished and not merged[0].request_finished
