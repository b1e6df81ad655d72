"""The tokenizer tier's Submit call as EngineOutputs (services/tokenizer/routing/
submit_stream.py): what piled up comes out merged per choice, never past a finish; the end,
a failure and the scheduler's deadline finish come out after the outputs before them;
CancelChoice names the choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from protos.llmserve.v1 import logprobs_pb2, scheduler_pb2
from services.contracts.errors import DeadlineExceededError, DependencyUnavailableError
from services.contracts.sampling_params import SamplingParams
from services.tokenizer.output import SchedulerOutput
from services.tokenizer.routing.pool import SchedulerClient
from services.tokenizer.routing.submit_stream import SubmitStream
from services.tokenizer.validation import ValidatedRequest

REQUEST = ValidatedRequest("r1", (1, 2, 3), SamplingParams(n=2), (), None)


class FakeCall:
    """A Submit call that sends its script as soon as it is read, then ends (or fails)."""

    def __init__(self, script: Sequence[scheduler_pb2.SubmitResponse], error: Exception | None):
        self.script, self.error, self.cancelled = script, error, False

    def __aiter__(self) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        for response in self.script:
            yield response
        if self.error is not None:
            raise self.error

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeStub:
    def __init__(self, script: Sequence[scheduler_pb2.SubmitResponse], error: Exception | None):
        self.call = FakeCall(script, error)
        self.submitted: list[scheduler_pb2.SubmitRequest] = []
        self.cancelled_choices: list[scheduler_pb2.CancelChoiceRequest] = []

    def Submit(self, request: scheduler_pb2.SubmitRequest, timeout: float | None) -> FakeCall:
        self.submitted.append(request)
        return self.call

    def CancelChoice(self, request: scheduler_pb2.CancelChoiceRequest, timeout: float) -> Any:
        self.cancelled_choices.append(request)
        return asyncio.sleep(0, scheduler_pb2.CancelChoiceResponse())


def response(*token_ids: int, finish: str = "", index: int = 0) -> scheduler_pb2.SubmitResponse:
    return scheduler_pb2.SubmitResponse(
        token_ids=token_ids,
        logprobs=[logprobs_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in token_ids],
        finish_reason=finish,
        index=index,
    )


def client(stub: FakeStub, closed: bool = False) -> SchedulerClient:
    return SchedulerClient("127.0.0.1:1", channel=None, stub=stub, closed=closed)  # type: ignore[arg-type]


async def read_all(stream: SubmitStream) -> list[list[SchedulerOutput] | BaseException]:
    """Every batch `next_outputs` hands on, after the reader has queued the whole script."""
    await asyncio.sleep(0.01)
    batches: list[list[SchedulerOutput] | BaseException] = []
    while True:
        try:
            outputs = await stream.next_outputs()
        except Exception as exc:
            batches.append(exc)
            return batches
        if outputs is None:
            return batches
        batches.append(outputs)


def shapes(batches: list[list[SchedulerOutput] | BaseException]) -> list[Any]:
    """Each batch's outputs as (token ids, finish reason, choice); an error as itself."""
    return [
        batch
        if isinstance(batch, BaseException)
        else [(o.token_ids, o.finish_reason, o.index) for o in batch]
        for batch in batches
    ]


def run_script(
    script: Sequence[scheduler_pb2.SubmitResponse], error: Exception | None = None
) -> tuple[list[list[SchedulerOutput] | BaseException], FakeStub, SchedulerClient]:
    stub = FakeStub(script, error)
    scheduler = client(stub)

    async def scenario() -> list[list[SchedulerOutput] | BaseException]:
        stream = SubmitStream(scheduler, REQUEST, 0.0, None, {"request_id": "r1"})
        assert scheduler.num_in_flight == 1
        try:
            return await read_all(stream)
        finally:
            stream.cancel()
            await asyncio.sleep(0)

    batches = asyncio.run(scenario())
    return batches, stub, scheduler


def test_a_backlog_comes_out_merged_per_choice_and_stops_at_a_finish() -> None:
    batches, stub, scheduler = run_script(
        [
            response(1, index=0),
            response(2, index=1),
            response(3, index=0, finish="length"),
            response(4, index=1),
            response(finish="length", index=1),
        ]
    )
    assert [request.request_id for request in stub.submitted] == ["r1"]
    assert shapes(batches) == [
        [((1, 3), "length", 0), ((2,), "", 1)],
        [((4,), "length", 1)],
    ]
    first = batches[0]
    assert isinstance(first, list)
    assert [item.token_id for item in first[0].logprobs] == [1, 3]
    assert scheduler.num_in_flight == 0


def test_a_deadline_finish_raises_after_the_outputs_before_it() -> None:
    batches, _, _ = run_script([response(1), response(2), response(finish="deadline")])
    assert shapes(batches)[0] == [((1, 2), "", 0)]
    assert isinstance(batches[1], DeadlineExceededError)


def test_a_failed_call_raises_its_typed_error_after_the_outputs_before_it() -> None:
    failure = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "worker gone"
    )
    batches, _, _ = run_script([response(1)], failure)
    assert shapes(batches)[0] == [((1,), "", 0)]
    assert isinstance(batches[1], DependencyUnavailableError)
    assert "scheduler 127.0.0.1:1 is unavailable: worker gone" in str(batches[1])


def test_a_closed_scheduler_is_never_called() -> None:
    stub = FakeStub([response(1)], None)

    async def scenario() -> None:
        stream = SubmitStream(client(stub, closed=True), REQUEST, 0.0, None, {})
        with pytest.raises(DependencyUnavailableError, match="closed"):
            await stream.next_outputs()
        stream.cancel_choice(1)

    asyncio.run(scenario())
    assert stub.submitted == [] and stub.cancelled_choices == []


def test_cancel_choice_names_the_request_and_choice() -> None:
    stub = FakeStub([], None)

    async def scenario() -> None:
        stream = SubmitStream(client(stub), REQUEST, 0.0, None, {})
        stream.cancel_choice(1)
        await asyncio.sleep(0.01)
        stream.cancel()

    asyncio.run(scenario())
    assert [(c.request_id, c.index) for c in stub.cancelled_choices] == [("r1", 1)]
