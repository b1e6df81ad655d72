"""A scheduler call that failed, or whose channel closed, as the tier's typed error
(services.contracts.errors): what the client can act on keeps its meaning (retry, back off, fix a
field, too late), anything else is internal. Each door then maps the typed error to its own
status in one place."""

from __future__ import annotations

import grpc

from services.common.grpc_server import REASON_METADATA_KEY, retry_pushback_ms
from services.contracts.errors import (
    CapacityError,
    DeadlineExceededError,
    DependencyUnavailableError,
    InternalError,
    InvalidRequestError,
    LLMServeError,
    QueueFullError,
)
from services.tokenizer.scheduler_pool import SchedulerClient


def scheduler_gone(scheduler: SchedulerClient) -> DependencyUnavailableError:
    """A stream whose channel closed under it (or before it could start)."""
    if scheduler.draining:
        return DependencyUnavailableError(
            f"scheduler {scheduler.address} left the pool (no longer listed by DNS) before "
            "the request finished; retry"
        )
    return DependencyUnavailableError(
        f"the channel to scheduler {scheduler.address} closed (this tokenizer is stopping); retry"
    )


def scheduler_error(exc: grpc.aio.AioRpcError, address: str, left: bool = False) -> LLMServeError:
    """A failed Submit as our typed error. `left`: the scheduler left the pool (gone from
    DNS), so a lost connection is that."""
    code, details = exc.code(), exc.details() or ""
    if left and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return DependencyUnavailableError(
            f"scheduler {address} left the pool (no longer listed by DNS) and is unavailable: "
            f"{details}; retry"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return DependencyUnavailableError(f"scheduler {address} is unavailable: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        reasons = dict(exc.trailing_metadata() or ())
        if reasons.get(REASON_METADATA_KEY) == "queue_full":
            return QueueFullError(details, retry_pushback_ms(reasons))
        return CapacityError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(details or "deadline passed")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = details.partition(": ")
        return InvalidRequestError(field, message) if message else InvalidRequestError("", details)
    if code == grpc.StatusCode.CANCELLED:
        return DependencyUnavailableError(f"scheduler {address} cancelled the request")
    return InternalError(f"scheduler {address} failed: {code.name}: {details}")
