"""The ExportKv calls waiting for their plan (docs/prefix-cache.md, Prefix fetch): each answers
once the worker has copied its blocks out, with the step's result, or with the worker's loss.
The core (features/kv_exports.py) only finds the blocks and names them in a plan."""

from __future__ import annotations

import asyncio

from services.contracts.errors import InvalidRequestError
from services.contracts.kv_transfer import FAILED_TRANSFER_PREFIX
from services.contracts.step import BatchPlan, StepResult
from services.scheduler.worker_client import WorkerUnavailable


class ExportWaits:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[None]] = {}

    def wait(self, request_id: str) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def forget(self, request_id: str) -> None:
        """The caller went away (cancelled): the export still goes out, unanswered."""
        self._waiting.pop(request_id, None)

    def on_result(self, plan: BatchPlan, result: StepResult) -> None:
        for export in plan.kv_exports:
            future = self._waiting.pop(export.request_id, None)
            if future is None or future.done():
                continue
            reason = result.failed_sequences.get(export.request_id)
            if reason is None:
                future.set_result(None)
            else:
                # The worker refused the destination (another model, KV dtype or block size).
                detail = reason.removeprefix(FAILED_TRANSFER_PREFIX)
                future.set_exception(InvalidRequestError("kv_destination", detail))

    def fail_all(self, message: str) -> None:
        """The worker is gone, and the plans in flight with it."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(WorkerUnavailable(message))
        self._waiting.clear()
