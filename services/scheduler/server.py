"""The scheduler process: serves the Scheduler API (ids in, stream of ids out; GetStats) and
drives its worker through the step loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from protos.llmserve.v1 import lora_pb2, model_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.cache_keys import CacheKeys
from services.common.config_flags import add_config_flags, config_from_args
from services.common.grpc_server import (
    GrpcService,
    refusal_metadata,
    run_service,
    status_for,
)
from services.common.kv_destination_proto import kv_destination_from_proto
from services.common.lora_proto import lora_adapter_info_to_proto
from services.common.metrics_http import start_metrics_server
from services.common.model_description_proto import description_to_proto
from services.common.named_prompt import NamedPrompt
from services.common.prefix_hash import adapter_salt
from services.common.prompt_checks import check_token_ids
from services.common.prompt_store import PromptStore
from services.common.redis_store import RedisStore, open_store, redact_url
from services.common.sampling_proto import sampling_from_proto
from services.contracts.errors import InvalidRequestError, NotFoundError
from services.scheduler import lora_metrics, metrics, tenant_metrics
from services.scheduler.convert import event_to_proto, stats_to_proto
from services.scheduler.features.coalesce import QueueItem, merge_by_choice, take_batch
from services.scheduler.features.fair_share import Tenant
from services.scheduler.kv_handoff import disaggregates, prefill_call, prefix_fetch
from services.scheduler.prefix_index import PrefixIndexPublisher
from services.scheduler.request import Request
from services.scheduler.server_config import SchedulerServerConfig
from services.scheduler.step_loop import StepLoop, WorkerUnavailable

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerServerConfig, loop: StepLoop, scheduler_id: str) -> None:
        self.config = config
        self.loop = loop
        self.scheduler_id = scheduler_id

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        now = self.loop.clock()
        remaining = context.time_remaining()
        try:
            sampling = sampling_from_proto(request.sampling)
            # The tokenizer tier has checked it all; the worker would index its logits with
            # these ids, so an out-of-vocabulary one must not reach it from any client.
            description = self.loop.description
            sampling.validate(vocab_size=description.model.vocab_size if description else None)
            if not request.prompt_token_ids:
                raise InvalidRequestError("prompt_token_ids", "must not be empty")
            if self.loop.description is not None:
                vocab_size = self.loop.description.model.vocab_size
                check_token_ids("prompt_token_ids", request.prompt_token_ids, vocab_size)
            scheduled = Request(
                request_id=request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling=sampling,
                eos_token_ids=tuple(self.loop.description.model.eos_token_ids)
                if self.loop.description
                else (),
                arrival_time=now,
                deadline=None if remaining is None else now + remaining,
                cache_salt=adapter_salt(bytes(request.cache_salt), request.lora_name),
                lora_name=request.lora_name,
            )
            tenant = Tenant(request.tenant_id, max(1, request.tenant_weight))
            # Disaggregation: a decode pair's request may name a prefill pair; a prefill
            # pair's, where its KV goes (docs/disaggregation.md).
            # Prefix fetch: another pair holds more of its prefix (docs/prefix-cache.md).
            prefill, fetch = None, None
            if request.prefill_scheduler and disaggregates(sampling):
                prefill = prefill_call(request)
            elif description is not None:
                fetch = prefix_fetch(request, description.block_size)
            queue = self.loop.submit(
                scheduled,
                tenant=tenant,
                prefill=prefill,
                kv_destination=kv_destination_from_proto(request.kv_destination),
                fetch=fetch,
            )
            metrics.on_admitted(scheduled)
            lora_metrics.on_admitted(request.lora_name)
            log.info(
                "admitted",
                extra={"request_id": request_id, "prompt_tokens": scheduled.num_prompt_tokens},
            )
            # A cancelled stream paused at `yield` gets no CancelledError (grpc 1.85); the
            # done callback frees the blocks the moment the RPC ends, however it ends.
            context.add_done_callback(lambda _: self.loop.abort(request_id))
        except WorkerUnavailable as exc:
            metrics.on_rejected("worker_unavailable")
            log.info("rejected", extra={"request_id": request_id, "code": "UNAVAILABLE"})
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:  # typed errors → their status; anything else → INTERNAL
            code, message = status_for(exc)
            metrics.on_rejected(exc)
            tenant_metrics.on_rejected(request.tenant_id, exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("submit failed", extra={"request_id": request_id})
            else:
                log.info("rejected", extra={"request_id": request_id, "code": code.name})
            # The reason tells a full queue (retry later: the pushback says when) from a
            # prompt that can never fit, which share RESOURCE_EXHAUSTED.
            context.set_trailing_metadata(refusal_metadata(exc))
            await context.abort(code, message)
        first = True
        # Events that arrived while the last message waited for the reader: they go out as
        # one message (coalesce.py), so a slow reader costs fewer messages, not more.
        backlog: deque[QueueItem] = deque()
        try:
            while True:
                if not backlog:
                    backlog.append(await queue.get())
                while not queue.empty():
                    backlog.append(queue.get_nowait())
                events = take_batch(backlog)
                if not events:
                    # An error or the deadline finish; the events before it went out already.
                    item = backlog.popleft()
                    if isinstance(item, BaseException):
                        log.warning(
                            "request failed", extra={"request_id": request_id, "error": item}
                        )
                        # A grammar the worker refused is the client's to fix, and an adapter
                        # gone from the worker is not found; anything else is the worker
                        # going away.
                        code = (
                            status_for(item)[0]
                            if isinstance(item, (InvalidRequestError, NotFoundError))
                            else grpc.StatusCode.UNAVAILABLE
                        )
                        await context.abort(code, str(item))
                    else:
                        await context.abort(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"request {request_id} passed its deadline",
                        )
                for event in merge_by_choice(events):
                    response = event_to_proto(event)
                    if scheduled.lora_name:
                        lora_metrics.on_tokens(scheduled.lora_name, len(event.new_token_ids))
                    if first:
                        queued = self.loop.queue_seconds(scheduled)
                        metrics.on_first_scheduled(queued)
                        tenant_metrics.on_first_scheduled(request.tenant_id, queued)
                        response.queue_ms = (queued or 0.0) * 1000
                        first = False
                    yield response
                if events[-1].request_finished:
                    return
        finally:
            # Client gone, deadline, or done: free the blocks now (no-op when finished).
            self.loop.abort(request_id)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        stats = self.loop.stats()
        description = self.loop.description
        if stats is None or description is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        assert stats is not None and description is not None
        return stats_to_proto(
            stats,
            self.scheduler_id,
            self.config.max_waiting_requests,
            block_size=description.block_size,
            worker_epoch=description.worker_epoch,
            max_num_seqs=self.config.max_num_seqs,
            dtype=description.dtype,
            kv_cache_dtype=description.kv_cache_dtype,
            quantization=description.quantization,
            lora_adapters=self.loop.loras.names,
            max_loras=description.max_loras,
            role=self.config.role,
        )

    async def Describe(
        self, request: model_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.ModelDescription:
        """The connected worker's model facts, passed on as it reported them."""
        description = self.loop.description
        if not self.loop.connected.is_set() or description is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        assert description is not None
        return description_to_proto(description.model)

    async def Pin(
        self, request: scheduler_pb2.PinRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.PinResponse:
        try:
            if not request.name:
                raise InvalidRequestError("name", "must not be empty")
            if not request.token_ids:
                raise InvalidRequestError("token_ids", "must not be empty")
            if request.ttl_s <= 0:
                raise InvalidRequestError("ttl_s", "must be > 0")
            if self.loop.description is not None:
                vocab_size = self.loop.description.model.vocab_size
                check_token_ids("token_ids", request.token_ids, vocab_size)
            pinned = await self.loop.pins.pin(
                request.name, list(request.token_ids), bytes(request.cache_salt), request.ttl_s
            )
        except WorkerUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:
            code, message = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("pin failed", extra={"pin": request.name})
            await context.abort(code, message)
        log.info("pinned", extra={"pin": request.name, "tokens": pinned})
        return scheduler_pb2.PinResponse(num_pinned_tokens=pinned)

    async def Unpin(
        self, request: scheduler_pb2.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.UnpinResponse:
        return scheduler_pb2.UnpinResponse(unpinned=self.loop.pins.unpin(request.name))

    async def CancelChoice(
        self, request: scheduler_pb2.CancelChoiceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CancelChoiceResponse:
        self.loop.abort_choice(request.request_id, request.index)
        return scheduler_pb2.CancelChoiceResponse()

    async def ExportKv(
        self, request: scheduler_pb2.ExportKvRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ExportKvResponse:
        """Another pair's request fetches a prefix this pool holds (docs/prefix-cache.md)."""
        destination = kv_destination_from_proto(request.kv_destination)
        try:
            if destination is None:
                raise InvalidRequestError("kv_destination", "must name the receiving worker")
            num_blocks = await self.loop.export_kv(
                request.request_id, list(request.prompt_token_ids), destination
            )
        except Exception as exc:  # typed errors → their status; anything else → INTERNAL
            code, message = status_for(exc)
            metrics.KV_EXPORTS.labels("refused").inc()
            if code is grpc.StatusCode.INTERNAL:
                log.exception("kv export failed", extra={"request_id": request.request_id})
            await context.abort(code, message)
        metrics.KV_EXPORTS.labels("sent").inc()
        return scheduler_pb2.ExportKvResponse(num_blocks=num_blocks)

    async def LoadLoraAdapter(
        self, request: lora_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.LoraAdapterInfo:
        if not request.name or not request.path:
            field = "name" if not request.name else "path"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: must not be empty")
        try:
            info = await self.loop.load_lora_adapter(request.name, request.path)
        except Exception as exc:
            await _abort_lora_call(context, exc, "load", request.name)
        log.info("LoRA adapter loaded", extra={"lora_name": request.name, "load_ms": info.load_ms})
        return lora_adapter_info_to_proto(info)

    async def UnloadLoraAdapter(
        self, request: lora_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.UnloadLoraAdapterResponse:
        try:
            await self.loop.unload_lora_adapter(request.name)
        except Exception as exc:
            await _abort_lora_call(context, exc, "unload", request.name)
        log.info("LoRA adapter unloaded", extra={"lora_name": request.name})
        return lora_pb2.UnloadLoraAdapterResponse(num_unloaded_schedulers=1)

    async def ListLoraAdapters(
        self, request: lora_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.ListLoraAdaptersResponse:
        try:
            adapters = await self.loop.list_lora_adapters()
        except Exception as exc:
            await _abort_lora_call(context, exc, "list", "")
        return lora_pb2.ListLoraAdaptersResponse(
            adapters=[lora_adapter_info_to_proto(info) for info in adapters]
        )


async def _abort_lora_call(
    context: grpc.aio.ServicerContext, exc: Exception, what: str, lora_name: str
) -> NoReturn:
    """A LoRA call's error as its status: UNAVAILABLE without a worker, the typed errors'
    own (NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT naming the field), INTERNAL else."""
    if isinstance(exc, WorkerUnavailable):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception(f"LoRA {what} failed", extra={"lora_name": lora_name})
    await context.abort(code, message)
    raise AssertionError("unreachable")  # abort raises


async def serve(config: SchedulerServerConfig) -> None:
    service = GrpcService.internal("scheduler", [SERVICE_NAME], config.internal_secret)

    def on_connection_change(connected: bool) -> None:
        # Health follows the worker: SERVING only while a warm worker is connected.
        if not service.stopping:
            asyncio.get_running_loop().create_task(service.set_serving(connected))

    # The id is known once the port is bound, and the prefix index is keyed by it, so the
    # Redis side is wired up after start() (no request can arrive before the worker anyway).
    step_loop = StepLoop(config, on_connection_change=on_connection_change)
    servicer = SchedulerServicer(config, step_loop, config.scheduler_id)
    service.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)
    port = await service.start(config.host, config.port)
    servicer.scheduler_id = config.scheduler_id or f"{config.host}:{port}"
    log.info("scheduler listening", extra={"address": f"{config.host}:{port}"})
    start_metrics_server(metrics.REGISTRY, config.host, config.metrics_port, "scheduler")
    redis = RedisLink.connect(config, servicer.scheduler_id, step_loop)
    tasks = [
        asyncio.create_task(step_loop.run()),
        asyncio.create_task(step_loop.pins.expire_forever()),
    ]
    if redis is not None:
        tasks.append(asyncio.create_task(redis.publisher.run()))
    await service.wait_for_signal()
    await service.drain_and_stop(config.drain_s)
    for task in tasks:
        task.cancel()
    if redis is not None:
        await redis.store.close()


class RedisLink:
    """This scheduler's Redis side: the prefix-index publisher and the named-prompt reader."""

    def __init__(self, store: RedisStore, scheduler_id: str, loop: StepLoop, ttl_s: float):
        self.store = store
        self.publisher = PrefixIndexPublisher(store, scheduler_id, ttl_s=ttl_s)
        loop.prefix_index = self.publisher
        loop.pins.registered_prompts = self.registered_prompts

    @classmethod
    def connect(
        cls, config: SchedulerServerConfig, scheduler_id: str, loop: StepLoop
    ) -> RedisLink | None:
        store = open_store(config.redis_url, metrics.REDIS)
        if store is None:
            return None
        log.info("redis configured", extra={"redis": redact_url(store.url)})
        return cls(store, scheduler_id, loop, config.prefix_index_ttl_s)

    async def registered_prompts(self, model_name: str) -> list[NamedPrompt] | None:
        return await PromptStore(self.store, CacheKeys(model_name)).list(None)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("scheduler", help="run the scheduler service")
    add_config_flags(parser, SchedulerServerConfig)
    parser.set_defaults(
        func=lambda args: run_service(lambda: serve(config_from_args(SchedulerServerConfig, args)))
    )
