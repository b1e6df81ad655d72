"""Decode side: the outcome of each KV transfer into this worker, for whoever waits on it
(KvTransfer.AwaitKv, docs/disaggregation.md). The decode scheduler treats a request's KV as in
place only once its own worker answers here, so the prefill worker's first token never has to
wait for the push. The wait and the push may come in either order; event loop only."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc


class TransferFailed(Exception):
    """The transfer ended without its blocks written; `code` is the status the push got."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class KvArrivals:
    MAX_KEPT = 4096
    """Outcomes remembered for a wait still to come (it follows within a second or so; the
    oldest are forgotten first)."""

    def __init__(self) -> None:
        self._outcomes: OrderedDict[str, asyncio.Future[int]] = OrderedDict()

    def written(self, request_id: str, num_blocks: int) -> None:
        future = self._future(request_id)
        if not future.done():
            future.set_result(num_blocks)

    def failed(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        future = self._future(request_id)
        if not future.done():
            future.set_exception(TransferFailed(code, message))

    async def wait(self, request_id: str) -> int:
        """The blocks written by the transfer of `request_id`, once it ends; raises
        TransferFailed if it failed. The outcome is consumed."""
        future = self._future(request_id)
        try:
            return await asyncio.shield(future)
        finally:
            # Answered, or the waiter gave up (the decode side falls back): forget it either way.
            if self._outcomes.get(request_id) is future:
                del self._outcomes[request_id]

    def __len__(self) -> int:
        return len(self._outcomes)

    def _future(self, request_id: str) -> asyncio.Future[int]:
        future = self._outcomes.get(request_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            # An outcome nobody waits for is normal (a fallback came first): not an error.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._outcomes[request_id] = future
            while len(self._outcomes) > self.MAX_KEPT:
                self._outcomes.popitem(last=False)
        return future
