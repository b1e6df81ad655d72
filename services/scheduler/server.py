"""The scheduler process: serves the Engine API (ids in, stream of ids out; GetStats) and
drives its worker through the step loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from protos.llmserve.v1 import engine_pb2, engine_pb2_grpc
from services.common.config_flags import add_config_flags, config_from_args
from services.common.errors import InvalidRequestError
from services.common.grpc_server import GrpcService, run_service, status_for
from services.common.prompt_checks import check_token_ids
from services.common.sampling_proto import sampling_from_proto
from services.scheduler.convert import event_to_proto, stats_to_proto
from services.scheduler.engine_loop import EngineLoop, WorkerUnavailable
from services.scheduler.plan import FinishReason
from services.scheduler.request import Request
from services.scheduler.server_config import SchedulerServerConfig

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, config: SchedulerServerConfig, loop: EngineLoop, scheduler_id: str) -> None:
        self.config = config
        self.loop = loop
        self.scheduler_id = scheduler_id

    async def Submit(
        self, request: engine_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SubmitResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        now = self.loop.clock()
        remaining = context.time_remaining()
        try:
            sampling = sampling_from_proto(request.sampling)
            sampling.validate()
            if not request.prompt_token_ids:
                raise InvalidRequestError("prompt_token_ids", "must not be empty")
            if self.loop.description is not None:
                check_token_ids(
                    "prompt_token_ids", request.prompt_token_ids, self.loop.description.vocab_size
                )
            scheduled = Request(
                request_id=request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling=sampling,
                eos_token_ids=tuple(self.loop.description.eos_token_ids)
                if self.loop.description
                else (),
                arrival_time=now,
                deadline=None if remaining is None else now + remaining,
            )
            queue = self.loop.submit(scheduled)
            # A cancelled stream paused at `yield` gets no CancelledError (grpc 1.85); the
            # done callback frees the blocks the moment the RPC ends, however it ends.
            context.add_done_callback(lambda _: self.loop.abort(request_id))
        except WorkerUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:  # typed errors → their status; anything else → INTERNAL
            code, message = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("submit failed", extra={"request_id": request_id})
            await context.abort(code, message)
        first = True
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                assert not isinstance(item, BaseException)
                if item.finish_reason is FinishReason.DEADLINE:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"request {request_id} passed its deadline",
                    )
                response = event_to_proto(item)
                if first:
                    queued = self.loop.queue_seconds(scheduled)
                    response.queue_ms = (queued or 0.0) * 1000
                    first = False
                yield response
                if item.finished:
                    return
        finally:
            # Client gone, deadline, or done: free the blocks now (no-op when finished).
            self.loop.abort(request_id)

    async def GetStats(
        self, request: engine_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStats:
        stats = self.loop.stats()
        if stats is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        assert stats is not None
        return stats_to_proto(stats, self.scheduler_id, self.config.max_waiting_requests)


async def serve(config: SchedulerServerConfig) -> None:
    service = GrpcService("scheduler", [SERVICE_NAME])

    def on_connection_change(connected: bool) -> None:
        # Health follows the worker: SERVING only while a warm worker is connected.
        if not service.stopping:
            asyncio.get_running_loop().create_task(service.set_serving(connected))

    engine_loop = EngineLoop(config, on_connection_change=on_connection_change)
    servicer = EngineServicer(config, engine_loop, config.scheduler_id)
    service.add(engine_pb2_grpc.add_EngineServicer_to_server, servicer)
    port = await service.start(config.host, config.port)
    servicer.scheduler_id = config.scheduler_id or f"{config.host}:{port}"
    log.warning("scheduler listening", extra={"address": f"{config.host}:{port}"})
    runner = asyncio.create_task(engine_loop.run())
    await service.wait_for_signal()
    await service.drain_and_stop(config.drain_s)
    runner.cancel()


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("scheduler", help="run the scheduler service")
    add_config_flags(parser, SchedulerServerConfig)
    parser.set_defaults(
        func=lambda args: run_service(lambda: serve(config_from_args(SchedulerServerConfig, args)))
    )
