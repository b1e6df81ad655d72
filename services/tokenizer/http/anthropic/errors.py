"""Our typed errors as Anthropic error responses. The status comes from the OpenAI door's
mapping (openai_http/errors.py, the tier's one map to HTTP statuses); the parameter names and
the body's shape are Anthropic's:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: ..."},
     "request_id": "..."}

400 invalid_request_error   401 authentication_error   403 permission_error
404 not_found_error         405 invalid_request_error  408 timeout_error
413 invalid_request_error   415 invalid_request_error  429 rate_limit_error (Retry-After)
503 overloaded_error        504 timeout_error          500 api_error

A stream that fails after its first event carries the same body as an `error` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.contracts.errors import InvalidRequestError, PromptTooLongError
from services.tokenizer.http.openai.errors import http_error

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    # Anthropic's docs name 413 `request_too_large`, a type its published error schema
    # lacks: the schema's type, the status tells the rest.
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}

# Fields as validation names them (text.proto's spelling) → as the Messages API spells them.
_PARAMS = {
    "sampling.max_new_tokens": "max_tokens",
    "sampling.stop": "stop_sequences",
    "prompt": "messages",
    "prompt_token_ids": "messages",
}


@dataclass(frozen=True, slots=True)
class AnthropicError:
    status: int
    type: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    grpc_code_name: str = "INTERNAL"
    """The same outcome as a gRPC code name, for the metrics the doors share."""
    request_id: str | None = None
    """The request's id (also the `request-id` header); None before one was given."""

    def body(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {"type": self.type, "message": self.message},
            "request_id": self.request_id,
        }


def anthropic_param(field_name: str) -> str:
    if field_name in _PARAMS:
        return _PARAMS[field_name]
    return field_name.removeprefix("sampling.")


def transport_error(status: int, message: str) -> AnthropicError:
    """A request refused for how it arrived (its size, its pace), before any route."""
    return AnthropicError(status, ERROR_TYPES.get(status, "api_error"), message)


def anthropic_error(exc: BaseException, request_id: str | None = None) -> AnthropicError:
    if isinstance(exc, InvalidRequestError):
        # Renamed before the shared mapping, whose own renames are OpenAI's.
        renamed = type(exc) if isinstance(exc, PromptTooLongError) else InvalidRequestError
        exc = renamed(anthropic_param(exc.field), exc.message)
    error = http_error(exc, chat=True)
    message = error.message
    if isinstance(exc, PromptTooLongError) and error.param:
        # OpenAI's shape names it in `param`; Anthropic's has only the message.
        message = f"{error.param}: {message}"
    return AnthropicError(
        error.status,
        ERROR_TYPES.get(error.status, "api_error"),
        message,
        # Anthropic's clients read the id from this header (APIStatusError.request_id).
        {**error.headers, "request-id": request_id} if request_id else error.headers,
        error.grpc_code_name,
        request_id,
    )


def route_error(status: int, method: str, path: str, headers: dict[str, str]) -> AnthropicError:
    """A request for no route of the door (404), or with a method its route does not take
    (405, with the route's `Allow` header)."""
    if status == 404:
        return AnthropicError(404, "not_found_error", f"no route {method} {path}")
    if status == 405:
        allowed = headers.get("allow", headers.get("Allow", ""))
        message = f"method {method} is not allowed on {path}"
        if allowed:
            message += f" (allowed: {allowed})"
        return AnthropicError(405, "invalid_request_error", message, headers)
    return transport_error(status, f"{method} {path}: refused")
