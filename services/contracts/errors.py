"""Typed errors. Validation raises them with the field at fault; each shell maps them to a
status (a gRPC code, a CLI exit) in one place. Their messages quote a client's strings through
`quoted`, so an error never echoes a long input back."""

from __future__ import annotations


class LLMServeError(Exception):
    """Base class of every error this project raises on purpose."""


class InvalidRequestError(LLMServeError, ValueError):
    """A request field has a bad value. `field` names it as the public API spells it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for output in the context (a distinct metric label)."""


class NotFoundError(LLMServeError):
    """A named thing (e.g. a registered prompt) does not exist. `field` names the reference."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class AlreadyExistsError(LLMServeError):
    """A name is taken (e.g. a LoRA adapter loaded under it already): unload it first."""


class ConflictError(LLMServeError):
    """The target's state refuses the call for now (e.g. no slot for one more LoRA adapter, an
    adapter in use); the same call may succeed once that changes."""


class DependencyUnavailableError(LLMServeError):
    """A service this call needs (e.g. Redis for named prompts) is not answering; retry."""


class CapacityError(LLMServeError):
    """The request can never fit (e.g. its prompt needs more KV blocks than exist)."""


class QueueFullError(LLMServeError):
    """The scheduler holds max_num_seqs + max_waiting_requests requests; the caller should back
    off, for `retry_after_ms` when the scheduler estimated it (None: no estimate)."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class RateLimitedError(LLMServeError):
    """The caller's API key is over one of its limits; `limit` names which (max_concurrent,
    rpm, tpm), and the caller should back off for `retry_after_ms`."""

    def __init__(self, limit: str, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_ms = retry_after_ms


class DeadlineExceededError(LLMServeError):
    """The request's deadline passed before it finished."""


class UnauthenticatedError(LLMServeError):
    """The call carries no API key, or one this server does not know."""


class PermissionDeniedError(LLMServeError):
    """The caller's key does not allow this (an admin call, another tenant's data)."""


class InternalError(LLMServeError):
    """Something on our side failed (e.g. a scheduler answered with an internal error); the
    message says what, without secrets."""


class ModelLoadError(LLMServeError):
    """A model file or directory cannot be read or is of an unsupported kind."""


QUOTED_CHARS = 48
"""The most of a client's own string an error message quotes."""


def quoted(value: str, limit: int = QUOTED_CHARS) -> str:
    """`value` quoted for an error message, cut to its first `limit` characters with an
    ellipsis. A message may quote what the client sent, never all of it: a gRPC status message
    travels in a header, and 8 KB is the default limit for all of a response's headers."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}…"


def shortened(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the last one an ellipsis when it was cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
