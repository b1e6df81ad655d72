"""Grammar readiness: a request with structured output waits while the worker compiles its
grammar, so that no step waits for a compile; the requests behind it may go first.

The step loop asks the worker to compile (off its step loop) and says when it is done; until
then the scheduler core passes the request over at admission, and fair shares do not free a
seat for it. Pure: a set of sequence ids, dropped when the request leaves.
"""

from __future__ import annotations

from services.scheduler.request import Request


class GrammarReadiness:
    def __init__(self) -> None:
        self._compiling: set[str] = set()  # membership only, never iterated

    def hold(self, request_id: str) -> None:
        """The request's grammar is being compiled: not admitted until `ready`."""
        self._compiling.add(request_id)

    def ready(self, request_id: str) -> None:
        self._compiling.discard(request_id)

    def is_ready(self, request: Request) -> bool:
        return request.request_id not in self._compiling

    def request_ids(self) -> set[str]:
        """The sequences it keeps state for (the core's integrity check)."""
        return set(self._compiling)

    def forget(self, request_id: str) -> None:
        """The request left the scheduler."""
        self._compiling.discard(request_id)
