"""Our typed errors as OpenAI error responses: the one mapping to HTTP statuses.

{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

400 invalid_request_error  a bad field (param names it as the HTTP API spells it)
408 timeout                the request body was not received in time (--http-timeout-s)
413 invalid_request_error  the request body is over --http-max-body-bytes
415 invalid_request_error  the request body is not JSON (its Content-Type)
401 authentication_error   no key, or an unknown one
403 permission_error       the key may not do this (admin calls, another tenant)
404 not_found_error        unknown model, unknown prompt_name, unknown route, unknown LoRA
                           adapter (code model_not_found when the parameter is the model)
409 invalid_request_error  a name taken (code already_exists: a LoRA adapter loaded already),
                           or a state that refuses the call for now (code conflict: no LoRA
                           slot on a worker)
429 rate_limit_error       the scheduler's queue is full (Retry-After: its hint, in seconds), or
                           the API key is over a limit (code rate_limit_exceeded; Retry-After
                           and the x-ratelimit-* headers)
503 service_unavailable    no scheduler with a worker, or still loading (Retry-After)
504 timeout                the request's deadline passed
500 server_error           anything else (the message says which part failed)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.contracts.errors import (
    AlreadyExistsError,
    CapacityError,
    ConflictError,
    DeadlineExceededError,
    DependencyUnavailableError,
    InvalidRequestError,
    LLMServeError,
    NotFoundError,
    PermissionDeniedError,
    PromptTooLongError,
    QueueFullError,
    RateLimitedError,
    UnauthenticatedError,
)
from services.tokenizer.access.limits import KeyOverLimitError

RETRY_AFTER_S = 1
"""What a 503, or a 429 without the scheduler's hint, asks the client to wait, in seconds."""


def retry_after_s(retry_after_ms: int | None) -> int:
    """The Retry-After header's whole seconds for a hint in milliseconds: rounded up, at
    least 1 (0 would invite an immediate retry); RETRY_AFTER_S without a hint."""
    if retry_after_ms is None:
        return RETRY_AFTER_S
    return max(1, math.ceil(retry_after_ms / 1000))


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def grpc_code_name(self) -> str:
        """The same outcome as a gRPC code name, for the metrics both doors share."""
        if self.code == "conflict":
            return "FAILED_PRECONDITION"  # the other 409, ALREADY_EXISTS, is the table's
        return _GRPC_NAMES.get(self.status, "INTERNAL")


_GRPC_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def http_param(field_name: str, chat: bool) -> str:
    """A field as validation names it (text.proto's spelling) → as the HTTP API spells it."""
    renames = {
        "sampling.max_new_tokens": "max_completion_tokens" if chat else "max_tokens",
        "sampling.min_new_tokens": "min_tokens",
        "sampling.logprobs": "top_logprobs" if chat else "logprobs",
        "prompt_token_ids": "prompt",
        "prompt": "messages" if chat else "prompt",
        "request_id": "X-Request-Id",  # the HTTP door takes it from that header
    }
    if field_name in renames:
        return renames[field_name]
    return field_name.removeprefix("sampling.")


def http_error(exc: BaseException, chat: bool = False) -> HttpError:
    if isinstance(exc, PromptTooLongError):
        return HttpError(
            400,
            exc.message,
            "invalid_request_error",
            http_param(exc.field, chat),
            "context_length_exceeded",
        )
    if isinstance(exc, InvalidRequestError):
        param = http_param(exc.field, chat) or None
        message = exc.message if param is None else f"{param}: {exc.message}"
        return HttpError(400, message, "invalid_request_error", param)
    if isinstance(exc, CapacityError):
        return HttpError(400, str(exc), "invalid_request_error", None, "context_length_exceeded")
    if isinstance(exc, UnauthenticatedError):
        return HttpError(
            401,
            str(exc),
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if isinstance(exc, PermissionDeniedError):
        return HttpError(403, str(exc), "permission_error")
    if isinstance(exc, NotFoundError):
        code = "model_not_found" if exc.field == "model" else "not_found"
        return HttpError(404, exc.message, "not_found_error", exc.field, code)
    if isinstance(exc, AlreadyExistsError):
        return HttpError(409, str(exc), "invalid_request_error", code="already_exists")
    if isinstance(exc, ConflictError):
        return HttpError(409, str(exc), "invalid_request_error", code="conflict")
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, QueueFullError):
        return HttpError(
            429,
            f"the server is busy ({exc}); retry later",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after_s(exc.retry_after_ms))},
        )
    if isinstance(exc, RateLimitedError):
        quota = exc.quota.headers() if isinstance(exc, KeyOverLimitError) else {}
        return HttpError(
            429,
            str(exc),
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s(exc.retry_after_ms)), **quota},
        )
    if isinstance(exc, DependencyUnavailableError):
        return HttpError(503, str(exc), "service_unavailable", headers=retry)
    if isinstance(exc, DeadlineExceededError):
        return HttpError(504, str(exc), "timeout", code="deadline_exceeded")
    if isinstance(exc, LLMServeError):
        return HttpError(500, str(exc), "server_error")
    return HttpError(500, f"internal error: {type(exc).__name__}", "server_error")


_TRANSPORT_ERRORS = {
    408: ("timeout", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}


def transport_error(status: int, message: str) -> HttpError:
    """A request refused for how it arrived (its size, its pace), before any route."""
    kind, code = _TRANSPORT_ERRORS.get(status, ("invalid_request_error", None))
    return HttpError(status, message, kind, code=code)


def not_found_route(method: str, path: str) -> HttpError:
    return HttpError(404, f"no route {method} {path}", "not_found_error", code="not_found")
