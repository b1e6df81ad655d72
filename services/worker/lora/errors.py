"""What can go wrong with an adapter; the worker's server maps each to a gRPC status once."""

from __future__ import annotations

from services.contracts.errors import InvalidRequestError, LLMServeError, NotFoundError


class LoraAdapterError(InvalidRequestError):
    """The adapter cannot be served by this worker: a format field we do not support, or
    shapes that do not fit the served model. `field` names the adapter's field at fault."""


class LoraNotFoundError(NotFoundError):
    """No adapter of that name is loaded."""


class LoraConflictError(LLMServeError):
    """The adapters' state refuses the call: a name already loaded, an adapter in use by a
    running sequence, no slot free, or a worker without slots."""

    def __init__(self, message: str, *, already_loaded: bool = False) -> None:
        super().__init__(message)
        self.already_loaded = already_loaded
