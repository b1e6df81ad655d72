"""Errors the scheduler raises on purpose (the engine shell maps them to gRPC codes)."""

from __future__ import annotations

from services.common.errors import LLMServeError


class QueueFullError(LLMServeError):
    """The waiting queue is at max_waiting_requests; the caller should back off."""
