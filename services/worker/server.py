"""The worker process: owns the device, the weights and the paged KV cache. Serves Describe
and one bidirectional Step stream (plan in, sampled ids out) at a time."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import torch

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.config_flags import add_config_flags, config_from_args
from services.common.grpc_server import GrpcService, run_service
from services.common.sampling_params import SamplingParams
from services.engine.config import GiB, resolve_dtype
from services.scheduler.plan import BatchPlan, NewSequence
from services.worker.config import WorkerConfig
from services.worker.convert import plan_from_proto, result_to_proto
from services.worker.loaded_model import LoadedModel
from services.worker.runner import ModelRunner

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.loaded: LoadedModel | None = None
        self.runner: ModelRunner | None = None
        self.epoch = uuid.uuid4().hex
        self._session = 0
        # One forward at a time; a newer Step stream takes over from an older one.
        self._lock = asyncio.Lock()

    def attach(self, loaded: LoadedModel, runner: ModelRunner) -> None:
        self.loaded = loaded
        self.runner = runner

    async def _ready(self, context: grpc.aio.ServicerContext) -> tuple[LoadedModel, ModelRunner]:
        if self.loaded is None or self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: model still loading")
        assert self.loaded is not None and self.runner is not None
        return self.loaded, self.runner

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerDescription:
        loaded, runner = await self._ready(context)
        model_config = loaded.model.config
        return worker_pb2.WorkerDescription(
            model_name=loaded.name,
            architecture=model_config.architecture,
            vocab_size=model_config.vocab_size,
            max_model_len=loaded.max_model_len(self.config.max_model_len),
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device),
            block_size=runner.kv_cache.spec.block_size,
            num_kv_blocks=runner.kv_cache.num_blocks,
            eos_token_ids=list(loaded.eos_token_ids),
            kv_cache_dtype=str(runner.kv_cache.spec.dtype).removeprefix("torch."),
            quantization="none",
            worker_epoch=self.epoch,
        )

    async def Step(
        self,
        request_iterator: AsyncIterator[worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        _, runner = await self._ready(context)
        # A new stream means a new scheduler session: whatever the old one held is gone.
        self._session += 1
        session = self._session
        async with self._lock:
            runner.reset()
        log.info("step stream opened", extra={"session": session})
        async for message in request_iterator:
            if session != self._session:
                await context.abort(grpc.StatusCode.ABORTED, "a newer Step stream took over")
            plan = plan_from_proto(message)
            async with self._lock:
                started = time.perf_counter()
                # The forward runs in a thread so health checks and Describe stay responsive.
                result = await asyncio.to_thread(runner.execute, plan)
                forward_ms = (time.perf_counter() - started) * 1000
            yield result_to_proto(result, forward_ms)
        log.info("step stream closed", extra={"session": session})


def warm_up(runner: ModelRunner) -> None:
    """One tiny prefill + decode so the first real request does not pay for lazy init."""
    prompt = list(range(1, 9))
    runner.reset()
    plan = BatchPlan(
        step_id=0,
        new_sequences=[NewSequence("warm-up", prompt, len(prompt), [0], 0, SamplingParams())],
        num_scheduled_tokens={"warm-up": len(prompt)},
    )
    runner.execute(plan)
    runner.execute(BatchPlan(step_id=1, num_scheduled_tokens={"warm-up": 1}))
    runner.reset()


async def serve(config: WorkerConfig) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)
    service = GrpcService("worker", [SERVICE_NAME])
    servicer = WorkerServicer(config)
    service.add(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
    # Listen first (health NOT_SERVING) so a supervisor sees the port while the model loads.
    port = await service.start(config.host, config.port)
    log.warning("worker listening", extra={"address": f"{config.host}:{port}"})
    dtype = resolve_dtype(config.dtype, config.device)
    loaded = await asyncio.to_thread(LoadedModel.load, config.model, dtype, config.device)
    runner = ModelRunner.create(
        loaded,
        kv_cache_bytes=int(config.kv_cache_gib * GiB),
        block_size=config.block_size,
        seed=config.seed,
    )
    await asyncio.to_thread(warm_up, runner)
    servicer.attach(loaded, runner)
    await service.set_serving()
    log.warning(
        "worker serving",
        extra={"model": loaded.name, "dtype": str(dtype), "kv_blocks": runner.kv_cache.num_blocks},
    )
    await service.wait_for_signal()
    await service.drain_and_stop(config.drain_s)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("worker", help="run the worker service (model + KV cache)")
    add_config_flags(parser, WorkerConfig)
    parser.set_defaults(
        func=lambda args: run_service(lambda: serve(config_from_args(WorkerConfig, args)))
    )
