"""The scheduler's step loop: the pure Scheduler driven against a remote worker.

One long-lived bidirectional Step stream to the worker; each iteration sends a plan and waits
for its result, then hands the events to the requests' queues. If the worker goes away, every
in-flight request fails with WorkerUnavailable, all KV state is dropped (a fresh Scheduler),
and the loop reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import LLMServeError
from services.common.grpc_server import CHANNEL_OPTIONS
from services.scheduler.plan import BatchPlan, StepResult, TokenEvent
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerStats
from services.scheduler.server_config import SchedulerServerConfig
from services.worker.convert import plan_to_proto, result_from_proto

log = logging.getLogger(__name__)

EventQueue = asyncio.Queue[TokenEvent | BaseException]


class WorkerUnavailable(LLMServeError):
    """The worker is not connected (starting, restarting or gone)."""


class EngineLoop:
    def __init__(
        self,
        config: SchedulerServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_connection_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.on_connection_change = on_connection_change
        self.scheduler: Scheduler | None = None
        self.description: worker_pb2.WorkerDescription | None = None
        self._queues: dict[str, EventQueue] = {}
        self._scheduled_at: dict[str, float] = {}
        self._wakeup = asyncio.Event()
        self.connected = asyncio.Event()
        self.num_steps = 0

    # ---- the server's calls --------------------------------------------------------------

    def submit(self, request: Request) -> EventQueue:
        """Queue a request; its events arrive on the returned queue. Raises WorkerUnavailable,
        or the scheduler's typed errors (invalid, queue full, can never fit)."""
        if self.scheduler is None or not self.connected.is_set():
            raise WorkerUnavailable(f"worker {self.config.worker} is not connected")
        self.scheduler.add_request(request)
        queue: EventQueue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._wakeup.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; the worker drops it with the next plan."""
        self._queues.pop(request_id, None)
        self._scheduled_at.pop(request_id, None)
        if self.scheduler is not None:
            self.scheduler.abort_request(request_id)
            self._wakeup.set()

    def queue_seconds(self, request: Request) -> float | None:
        scheduled = self._scheduled_at.get(request.request_id)
        return None if scheduled is None else scheduled - request.arrival_time

    def stats(self) -> SchedulerStats | None:
        return None if self.scheduler is None else self.scheduler.get_stats()

    # ---- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, drive, and reconnect forever (until cancelled)."""
        backoff = 0.05
        while True:
            channel = grpc.aio.insecure_channel(self.config.worker, options=CHANNEL_OPTIONS)
            try:
                stub = worker_pb2_grpc.WorkerStub(channel)
                self.description = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
                self.scheduler = Scheduler(
                    self.config.scheduler_config(
                        self.description.block_size, self.description.max_model_len
                    ),
                    self.description.num_kv_blocks,
                )
                call = stub.Step()
                self._set_connected(True)
                backoff = 0.05
                log.warning(
                    "worker connected",
                    extra={
                        "worker": self.config.worker,
                        "kv_blocks": self.description.num_kv_blocks,
                        "epoch": self.description.worker_epoch,
                    },
                )
                await self._drive(call)
            except (grpc.aio.AioRpcError, WorkerUnavailable) as exc:
                if self.connected.is_set():
                    log.error(
                        "worker lost", extra={"worker": self.config.worker, "error": str(exc)}
                    )
                self._fail_all(f"worker {self.config.worker} is unavailable")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.reconnect_max_s)
            finally:
                self._set_connected(False)
                with contextlib.suppress(Exception):
                    await channel.close(grace=None)

    async def _drive(self, call: grpc.aio.StreamStreamCall) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        while True:
            if not scheduler.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
            plan = scheduler.schedule(self.clock())
            if _needs_worker(plan):
                self._note_scheduled(plan)
                await call.write(plan_to_proto(plan))
                output = await call.read()
                if output is grpc.aio.EOF:
                    raise WorkerUnavailable("the worker closed the step stream")
                result = result_from_proto(output)
                self.num_steps += 1
            else:
                result = StepResult(step_id=plan.step_id)
            self._dispatch(scheduler.update(plan, result, self.clock()))
            if plan.is_empty:
                # Requests wait for KV blocks or nothing is runnable: do not spin.
                await asyncio.sleep(0.002)

    def _note_scheduled(self, plan: BatchPlan) -> None:
        now = self.clock()
        for seq in plan.new_sequences:
            self._scheduled_at.setdefault(seq.request_id, now)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self._queues.get(event.request_id)
            if event.finished:
                self._queues.pop(event.request_id, None)
            if queue is not None:
                queue.put_nowait(event)

    def _fail_all(self, message: str) -> None:
        """Every in-flight request ends (the server maps this to UNAVAILABLE); KV is dropped."""
        for queue in self._queues.values():
            queue.put_nowait(WorkerUnavailable(message))
        self._queues.clear()
        self._scheduled_at.clear()
        self.scheduler = None

    def _set_connected(self, connected: bool) -> None:
        if connected == self.connected.is_set():
            return
        if connected:
            self.connected.set()
        else:
            self.connected.clear()
        if self.on_connection_change is not None:
            self.on_connection_change(connected)


def _needs_worker(plan: BatchPlan) -> bool:
    return bool(
        plan.num_scheduled_tokens or plan.finished_ids or plan.new_sequences or plan.block_copies
    )
