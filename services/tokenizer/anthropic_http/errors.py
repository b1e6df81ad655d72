"""Our typed errors as Anthropic error responses. The status comes from the OpenAI door's
mapping (openai_http/errors.py, the tier's one map to HTTP statuses); the parameter names and
the body's shape are Anthropic's:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: ..."}}

400 invalid_request_error   401 authentication_error   403 permission_error
404 not_found_error         408 timeout_error          413 request_too_large
415 invalid_request_error   429 rate_limit_error (Retry-After)
503 overloaded_error        504 timeout_error          500 api_error

A stream that fails after its first event carries the same body as an `error` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.contracts.errors import InvalidRequestError, PromptTooLongError
from services.tokenizer.openai_http.errors import http_error

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
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

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def anthropic_param(field_name: str) -> str:
    if field_name in _PARAMS:
        return _PARAMS[field_name]
    return field_name.removeprefix("sampling.")


def transport_error(status: int, message: str) -> AnthropicError:
    """A request refused for how it arrived (its size, its pace), before any route."""
    return AnthropicError(status, ERROR_TYPES.get(status, "api_error"), message)


def anthropic_error(exc: BaseException) -> AnthropicError:
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
        error.headers,
        error.grpc_code_name,
    )
