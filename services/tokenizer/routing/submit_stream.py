"""One request's Scheduler.Submit call, read as the tier's own data (SchedulerOutput, typed errors):
the gRPC side of a generation, so generation.py sees neither protobuf nor grpc.

A reader task moves the call's responses into a local queue as they arrive. What a slow client
let pile up there comes out of `next_outputs` at once: one SchedulerOutput per choice, merged
by scheduler_convert.py (protobuf's own merge, in C: k responses cost about one conversion). A
batch never goes past a finished response, and the call's end, its failure and the scheduler's
deadline finish come out only after every response before them, as they would one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping

import grpc

from protos.llmserve.v1 import scheduler_pb2
from services.common.backlog import take_leading
from services.contracts.errors import DeadlineExceededError
from services.tokenizer.output import SchedulerOutput
from services.tokenizer.routing import scheduler_convert
from services.tokenizer.routing.pool import SchedulerClient, closed_under
from services.tokenizer.routing.prefix_fetch import PrefixSource
from services.tokenizer.routing.scheduler_errors import scheduler_error, scheduler_gone
from services.tokenizer.validation import ValidatedRequest

log = logging.getLogger(__name__)

# What the reader task passes on from the scheduler stream: a response, the call's error, or
# None for its end.
SchedulerItem = scheduler_pb2.SubmitResponse | BaseException | None


class SubmitStream:
    """The call starts on construction. `next_outputs()` returns what arrived since the last
    call; `cancel()` ends the call at once (idempotent, synchronous: safe from a done
    callback); `cancel_choice()` ends one choice of an n > 1 request."""

    def __init__(
        self,
        scheduler: SchedulerClient,
        request: ValidatedRequest,
        arrival_unix_s: float,
        timeout_s: float | None,
        log_extra: Mapping[str, object],
        *,
        prefill_scheduler: str = "",
        prefix_source: PrefixSource | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._request_id = request.request_id
        self._extra = log_extra
        # A scheduler that left the pool may have closed its channel after routing chose it
        # (both doors await between the two): that request ends UNAVAILABLE, unsent.
        self._call: grpc.aio.UnaryStreamCall | None = None
        if not scheduler.closed:
            self._call = scheduler.stub.Submit(
                scheduler_convert.submit_request(
                    request, arrival_unix_s, prefill_scheduler, prefix_source
                ),
                timeout=timeout_s,
            )
        # The client may be slower than the scheduler. Read the scheduler stream at once into a
        # local queue: a stalled client must never stall the shared scheduler connection
        # (HTTP/2 flow control is per connection too).
        self._responses: asyncio.Queue[SchedulerItem] = asyncio.Queue()
        self._backlog: deque[SchedulerItem] = deque()
        self._reader = asyncio.create_task(_drain(self._call, self._responses, scheduler))
        # The stream is in flight until its reader ends, however it ends (a leaving
        # scheduler's channel closes when none is).
        scheduler.num_in_flight += 1
        self._reader.add_done_callback(lambda _: _release(scheduler))
        self._cancels: set[asyncio.Future[scheduler_pb2.CancelChoiceResponse]] = set()

    def cancel(self) -> None:
        """The scheduler's signal to free the request's KV blocks."""
        if self._call is not None:
            self._call.cancel()
        self._reader.cancel()

    def cancel_choice(self, index: int) -> None:
        """Has the scheduler free one choice's blocks while the others go on."""
        if self.scheduler.closed:
            return
        cancel = self.scheduler.stub.CancelChoice(
            scheduler_convert.cancel_choice_request(self._request_id, index), timeout=5.0
        )
        task = asyncio.ensure_future(cancel)
        # Best effort: a failure leaves the choice running until its own stop or length.
        task.add_done_callback(_log_cancel_failure)
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def next_outputs(self) -> list[SchedulerOutput] | None:
        """What the scheduler sent since the last call (waits for something): one
        SchedulerOutput per choice, in the order the choices first appear. None once the stream
        has ended. Raises a failed call as our typed error (scheduler_errors.py), and
        DeadlineExceededError for the scheduler's deadline finish."""
        backlog, responses = self._backlog, self._responses
        if not backlog:
            backlog.append(await responses.get())
        while not responses.empty():
            backlog.append(responses.get_nowait())
        batch = _take_batch(backlog)
        if batch:
            return scheduler_convert.scheduler_outputs_by_choice(batch)
        # The end of the stream, an error or the deadline finish; the responses before it
        # went out already, as they would have one at a time.
        item = backlog.popleft()
        if item is None:
            return None
        if isinstance(item, grpc.aio.AioRpcError):
            scheduler = self.scheduler
            error = scheduler_error(item, scheduler.address, left=scheduler.draining)
            log.warning(
                "scheduler call failed",
                extra={**self._extra, "code": item.code().name, "error": str(error)},
            )
            raise error
        if isinstance(item, BaseException):
            raise item
        log.info("deadline passed in the scheduler", extra=self._extra)
        raise DeadlineExceededError("deadline passed")


def _log_cancel_failure(task: asyncio.Future[scheduler_pb2.CancelChoiceResponse]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("cancelling a choice failed", extra={"error": str(task.exception())})


def _take_batch(backlog: deque[SchedulerItem]) -> list[scheduler_pb2.SubmitResponse]:
    """Pops the leading responses of `backlog` that go through as one: up to the stream's end,
    an error or a deadline finish (left in place), and never past a finished response."""
    return take_leading(
        backlog,
        mergeable=lambda head: (
            isinstance(head, scheduler_pb2.SubmitResponse) and head.finish_reason != "deadline"
        ),
        ends_batch=lambda response: bool(response.finish_reason),
    )


async def _drain(
    call: grpc.aio.UnaryStreamCall | None,
    queue: asyncio.Queue[SchedulerItem],
    scheduler: SchedulerClient,
) -> None:
    """Move every scheduler response into `queue`; None marks the end, an exception a failure.
    `call` None: it could not be made (the scheduler's channel had closed)."""
    try:
        if call is None:
            queue.put_nowait(scheduler_gone(scheduler))
            return
        async for response in call:
            queue.put_nowait(response)
        queue.put_nowait(None)
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(exc)
    except asyncio.CancelledError:
        if not closed_under(scheduler):
            raise
        # grpc.aio ends a call whose channel closes with a CancelledError, not a status.
        queue.put_nowait(scheduler_gone(scheduler))


def _release(scheduler: SchedulerClient) -> None:
    scheduler.num_in_flight -= 1
