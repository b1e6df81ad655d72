"""A scheduler call that failed, or whose channel closed, as the tier's typed error
(services.contracts.errors): what the client can act on keeps its meaning (retry, back off, fix a
field, too late), anything else is internal. Each door then maps the typed error to its own
status in one place."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from services.common.grpc_server import REASON_METADATA_KEY, retry_pushback_ms
from services.contracts.errors import (
    AlreadyExistsError,
    CapacityError,
    ConflictError,
    DeadlineExceededError,
    DependencyUnavailableError,
    InternalError,
    InvalidRequestError,
    LLMServeError,
    NotFoundError,
    QueueFullError,
)
from services.tokenizer.routing.pool import SchedulerClient


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


SUBMIT_FIELDS: Mapping[str, str] = {"lora_name": "model"}
"""Submit's fields the public API spells otherwise: a request names its adapter by `model`."""


def scheduler_error(
    exc: grpc.aio.AioRpcError,
    address: str,
    left: bool = False,
    public_fields: Mapping[str, str] = SUBMIT_FIELDS,
) -> LLMServeError:
    """A failed scheduler call (Submit unless told) as our typed error. `left`: the scheduler
    left the pool (gone from DNS), so a lost connection is that. A status naming a field
    ("field: message") keeps it, as `public_fields` renames it for the caller's API."""
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
    if code in _NAMING_FIELDS:
        field, _, message = details.partition(": ")
        if not message:
            field, message = "", details
        return _NAMING_FIELDS[code](public_fields.get(field, field), message)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExistsError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ConflictError(f"scheduler {address}: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return DependencyUnavailableError(f"scheduler {address} cancelled the request")
    return InternalError(f"scheduler {address} failed: {code.name}: {details}")


# The statuses whose details name the field at fault, and the error each becomes.
_NAMING_FIELDS: Mapping[grpc.StatusCode, type[InvalidRequestError | NotFoundError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
}
