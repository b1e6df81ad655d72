"""The worker process: owns the device, the weights and the paged KV cache. Serves Describe
and one bidirectional Step stream (plan in, sampled ids out) at a time.

One controller: the worker's batch belongs to the scheduler whose Step stream is live. A second
stream is refused (FAILED_PRECONDITION) without touching the live batch; the next stream is let
in once the live one has ended, however it ends: closed, cancelled, or its connection found
dead (a killed process's connection is reset at once; a hung or unreachable peer is dropped by
gRPC keepalive, SERVER_OPTIONS: a ping every 10 s, 5 s to answer). That is what a restarted
scheduler waits for, retrying as it does for a worker that is down. No takeover of a live
stream, whatever the caller presents: every stack member holds the secret, and two schedulers
sharing one worker by mistake would take turns wiping each other's batch."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch

from kernels import cpu_extension
from protos.llmserve.v1 import lora_pb2, worker_pb2, worker_pb2_grpc
from services.common.config_flags import add_config_flags, config_from_args
from services.common.grpc_server import GrpcService, run_service
from services.common.lora_proto import lora_adapter_info_to_proto
from services.common.metrics_http import start_metrics_server
from services.common.model_source import resolve_model_path
from services.common.sampling_proto import structured_output_from_proto
from services.contracts.errors import InvalidRequestError, LLMServeError, ModelLoadError
from services.contracts.memory_budget import MemoryBudget
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence, StepResult
from services.contracts.worker_description import WorkerDescription
from services.worker import kv_transfer_service, kv_transfer_shm, memory_budget, metrics
from services.worker.config import GiB, WorkerConfig, resolve_dtype
from services.worker.convert import (
    plan_from_proto,
    result_to_proto,
    worker_description_to_proto,
)
from services.worker.kv_cache import PagedKVCache
from services.worker.kv_disk_steps import KvDiskSteps, claim_directory
from services.worker.kv_transfer import CacheIdentity, KvInbox, KvOutbox, OutgoingKv, Transports
from services.worker.kv_transfer_service import KvSender, KvTransferServicer
from services.worker.loaded_model import LoadedModel
from services.worker.lora.errors import LoraAdapterError, LoraConflictError, LoraNotFoundError
from services.worker.quantization.formats import resolve_quantization, serves_gguf_blocks
from services.worker.runner import ModelRunner, StepMode

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Initial metadata of a Step stream the worker took as its controller's.
STEP_SESSION_KEY = "llmserve-step-session"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.loaded: LoadedModel | None = None
        self.runner: ModelRunner | None = None
        self.epoch = uuid.uuid4().hex
        self.host_identity = kv_transfer_shm.host_identity(config.kv_transfer_shm_dir)
        self._session = 0
        self._controller: Controller | None = None
        """The live Step stream, if any: the one scheduler driving the batch."""
        # Every forward runs on this one thread, in the order plans arrive: steps queue behind
        # each other without waiting for the event loop (which reads plans and sends results
        # meanwhile). Loading and warm-up run here too: OpenMP gives each thread that opens a
        # parallel region its own team, and the idle team of another thread keeps spinning
        # on the cores the forward needs (measured: a step 1.7x slower when the model was
        # loaded on one thread and stepped on another).
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        # Grammar compiles (PrepareGrammar) run beside the steps, never on the forward thread: a
        # JSON schema takes 10-100 ms to compile, and xgrammar releases the GIL meanwhile.
        self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        # Disaggregation (kv_transfer.py): prompts whose KV this worker sends to a decode pair.
        self.kv_outbox: KvOutbox | None = None
        self.kv_sender: KvSender | None = None
        self.kv_inbox: KvInbox | None = None

    async def on_forward_thread(self, function: Callable[..., T], *args: Any) -> T:
        """Run `function` on the thread the steps run on."""
        return await asyncio.get_running_loop().run_in_executor(
            self._forward_thread, function, *args
        )

    def attach(self, loaded: LoadedModel, runner: ModelRunner) -> None:
        self.loaded = loaded
        self.runner = runner
        identity = CacheIdentity.of(loaded.name, runner.kv_cache)
        transports = Transports(self.host_identity)
        self.kv_outbox = KvOutbox(identity, transports)
        self.kv_sender = KvSender(identity, self.config.internal_secret, transports)
        self.kv_inbox = KvInbox(identity, self.epoch)

    def kv_receiver(self) -> tuple[PagedKVCache, KvInbox] | None:
        """The cache KV transfers write into and its inbox, once the model is loaded."""
        if self.runner is None or self.kv_inbox is None:
            return None
        return self.runner.kv_cache, self.kv_inbox

    async def _ready(self, context: grpc.aio.ServicerContext) -> tuple[LoadedModel, ModelRunner]:
        if self.loaded is None or self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: model still loading")
        assert self.loaded is not None and self.runner is not None
        return self.loaded, self.runner

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerDescription:
        loaded, runner = await self._ready(context)
        description = WorkerDescription(
            model=loaded.describe(self.config.max_model_len),
            architecture=loaded.model.architecture.family,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device),
            block_size=runner.kv_cache.spec.block_size,
            num_kv_blocks=runner.kv_cache.num_blocks,
            kv_cache_dtype=str(runner.kv_cache.spec.dtype).removeprefix("torch."),
            quantization=loaded.quantization,
            worker_epoch=self.epoch,
            sliding_window=loaded.model.architecture.largest_window,
            max_loras=runner.adapters.max_loras,
            max_lora_rank=runner.adapters.max_lora_rank,
            batch_invariant=runner.batch_invariant,
            kv_disk_block_hashes=runner.kv_disk.tier.hashes() if runner.kv_disk else [],
            kv_disk_tier=runner.kv_disk is not None and runner.kv_disk.tier.enabled,
            host_identity=self.host_identity,
            memory=memory_budget.measure(loaded.model, runner.kv_cache, loaded.path)
            if runner.device.type == "cpu"
            else MemoryBudget(),
        )
        return worker_description_to_proto(description)

    async def LoadLoraAdapter(
        self, request: lora_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.LoraAdapterInfo:
        """Read, check and place an adapter on the forward thread: the slots it writes are the
        ones the steps read (a rank-16 adapter of the embedded model: tens of ms)."""
        _, runner = await self._ready(context)
        try:
            info = await self.on_forward_thread(
                runner.adapters.load, request.name, Path(request.path)
            )
        except (LoraAdapterError, LoraNotFoundError, LoraConflictError) as exc:
            await _abort_lora(context, exc)
        return lora_adapter_info_to_proto(info)

    async def UnloadLoraAdapter(
        self, request: lora_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.UnloadLoraAdapterResponse:
        _, runner = await self._ready(context)
        try:
            await self.on_forward_thread(runner.adapters.unload, request.name)
        except (LoraAdapterError, LoraNotFoundError, LoraConflictError) as exc:
            await _abort_lora(context, exc)
        return lora_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: lora_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.ListLoraAdaptersResponse:
        _, runner = await self._ready(context)
        adapters = await self.on_forward_thread(runner.adapters.list)
        return lora_pb2.ListLoraAdaptersResponse(
            adapters=[lora_adapter_info_to_proto(info) for info in adapters]
        )

    async def PrepareGrammar(
        self, request: worker_pb2.PrepareGrammarRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareGrammarResponse:
        """Compile a request's grammar into the runner's cache before the scheduler admits the
        request, so its sequence's first step finds it compiled."""
        _, runner = await self._ready(context)
        spec = structured_output_from_proto(request.structured_output)
        if spec is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "structured_output: is empty")
        assert spec is not None
        if runner.grammars is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this worker has no structured output"
            )
        assert runner.grammars is not None
        compiler = runner.grammars.compiler
        if compiler.is_compiled(spec):
            metrics.GRAMMAR_PREPARES.labels("cached").inc()
            return worker_pb2.PrepareGrammarResponse(compile_ms=0.0)
        started = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._grammar_thread, compiler.compile, spec
            )
        except InvalidRequestError as exc:
            metrics.GRAMMAR_PREPARES.labels("refused").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.GRAMMAR_PREPARES.labels("compiled").inc()
        compile_ms = (time.perf_counter() - started) * 1000
        log.info("grammar compiled", extra={"kind": spec.kind.value, "compile_ms": compile_ms})
        return worker_pb2.PrepareGrammarResponse(compile_ms=compile_ms)

    async def Step(
        self,
        request_iterator: AsyncIterator[worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        """Plans are queued on the forward thread the moment they arrive (a scheduler that
        overlaps sends plan N+1 while step N runs), and results go back in plan order."""
        _, runner = await self._ready(context)
        live = self._controller
        if live is not None:
            log.warning(
                "step stream refused: the worker has a controller",
                extra={"peer": context.peer(), "controller": live.peer, "session": live.session},
            )
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker is driven by another Step stream (session {live.session}); "
                "a new one is let in once that one ends",
            )
        # No await between the check above and this claim: no second stream slips in between.
        self._session += 1
        session = self._session
        self._controller = Controller(session, context.peer())
        # However the stream ends, the worker is free again; the done callback also covers a
        # stream cancelled while this generator waits at a `yield` (no CancelledError there).
        context.add_done_callback(lambda _: self._release(session))
        # A new controller starts from an empty batch: whatever an ended stream held is gone.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._forward_thread, runner.reset)
        outbox, sender, inbox = self.kv_outbox, self.kv_sender, self.kv_inbox
        assert outbox is not None and sender is not None and inbox is not None
        outbox.clear()
        # Sent before any plan arrives: the scheduler reports its worker connected only on it.
        await context.send_initial_metadata(((STEP_SESSION_KEY, str(session)),))
        log.info("step stream opened", extra={"session": session, "peer": context.peer()})
        steps: asyncio.Queue[tuple[BatchPlan, asyncio.Future[TimedResult]] | None]
        steps = asyncio.Queue()

        async def queue_plans() -> None:
            try:
                async for message in request_iterator:
                    if session != self._session:
                        break  # this stream ended and a newer one began: queue nothing more
                    plan = plan_from_proto(message)
                    _log_sequences(plan)
                    future = loop.run_in_executor(
                        self._forward_thread, _timed_step, runner, plan, outbox, inbox
                    )
                    steps.put_nowait((plan, future))
            finally:
                steps.put_nowait(None)

        reader = asyncio.create_task(queue_plans())
        queued: list[asyncio.Future[TimedResult]] = []
        try:
            while (item := await steps.get()) is not None:
                plan, future = item
                queued.append(future)
                try:
                    timed = await future
                except Exception:
                    scheduled = ",".join(plan.num_scheduled_tokens)
                    log.exception(
                        "step failed", extra={"step_id": plan.step_id, "request_ids": scheduled}
                    )
                    raise
                queued.remove(future)
                if timed.outgoing:
                    # Pushed beside the results, never in front of them: the decode side
                    # waits on its own worker (AwaitKv), not on this first token.
                    sender.start(timed.outgoing)
                metrics.on_step(plan, timed.forward_s, timed.mode)
                yield result_to_proto(timed.result, timed.forward_s * 1000)
            await reader  # re-raises a failure to read the stream
        finally:
            reader.cancel()
            # Steps of this stream not started yet are dropped; a newer stream resets first.
            while not steps.empty():
                item = steps.get_nowait()
                if item is not None:
                    queued.append(item[1])
            for future in queued:
                future.cancel()
            self._release(session)
            log.info("step stream closed", extra={"session": session})

    def _release(self, session: int) -> None:
        if self._controller is not None and self._controller.session == session:
            self._controller = None


@dataclass(frozen=True, slots=True)
class Controller:
    """The scheduler whose Step stream drives the batch."""

    session: int
    peer: str
    """Its address as gRPC sees it (ipv4:host:port), for logs."""


@dataclass(frozen=True, slots=True)
class TimedResult:
    result: StepResult
    forward_s: float
    mode: StepMode
    """Read on the forward thread: by the time the event loop sees this result, the runner
    may be running the next step."""
    outgoing: list[OutgoingKv]
    """Prompt KV copied out after this step, for decode workers (kv_transfer.py)."""


async def _abort_lora(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """An adapter call's error as its gRPC status: INVALID_ARGUMENT for an adapter that does
    not fit (the field named), NOT_FOUND, ALREADY_EXISTS for a loaded name, and
    FAILED_PRECONDITION for an adapter in use or a worker without slots."""
    code = grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, LoraAdapterError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, LoraNotFoundError):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, LoraConflictError) and exc.already_loaded:
        code = grpc.StatusCode.ALREADY_EXISTS
    await context.abort(code, str(exc))
    raise AssertionError("unreachable")  # abort raises


def _timed_step(
    runner: ModelRunner, plan: BatchPlan, outbox: KvOutbox, inbox: KvInbox
) -> TimedResult:
    """Run one plan on the forward thread, then copy out the KV due to decode workers (before
    any later plan can reuse those blocks); the plan's prefix exports are copied out before
    it runs. Transfers the plan gives up are closed first."""
    inbox.on_plan(plan, runner.batch.sequences)
    disk = runner.kv_disk.tier if runner.kv_disk is not None else None
    exported, failed_exports = outbox.export(plan, runner.kv_cache, disk)  # before its writes
    started = time.perf_counter()
    result = runner.execute(plan)
    forward_s = time.perf_counter() - started
    result.failed_sequences.update(failed_exports)
    outgoing = outbox.collect(plan, result, runner.batch.sequences, runner.kv_cache)
    return TimedResult(result, forward_s, runner.last_step_mode, [*exported, *outgoing])


def _log_sequences(plan: BatchPlan) -> None:
    """A line per sequence the worker takes on or drops, so a request id can be followed from
    the tokenizer tier into the worker (dropped: finished, aborted or preempted)."""
    if not log.isEnabledFor(logging.INFO):
        return  # the plan is walked only when someone reads the lines
    for request_id in plan.finished_request_ids:
        log.info("sequence dropped", extra={"request_id": request_id, "step_id": plan.step_id})
    for seq in plan.new_sequences:
        log.info(
            "sequence added",
            extra={
                "request_id": seq.request_id,
                "step_id": plan.step_id,
                "num_tokens": len(seq.token_ids),
                "num_computed_tokens": seq.num_computed_tokens,
            },
        )


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


def load_runner(config: WorkerConfig) -> tuple[LoadedModel, ModelRunner]:
    """Load the weights, size the KV cache, compile, warm up: on the forward thread, so one
    thread runs every parallel region the process ever runs (see WorkerServicer)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    # Before the weights: a directory another worker holds stops this start at once.
    disk_claim = claim_directory(Path(config.kv_disk_dir)) if config.kv_disk_dir else None
    gguf_blocks = serves_gguf_blocks(config.quantization, config.model)
    dtype = resolve_dtype(config.dtype, config.device, gguf_blocks=gguf_blocks)
    if config.device == "cpu":
        check_memory(config, dtype)
    loaded = LoadedModel.load(
        config.model, dtype, config.device, config.quantization, config.max_model_len
    )
    runner = ModelRunner.from_settings(loaded, config, config.max_model_len)
    runner.compile_step_graphs()
    log_kernel_path(runner.device)
    warm_up(runner)
    if config.kv_disk_dir:
        runner.kv_disk = KvDiskSteps.open(
            Path(config.kv_disk_dir),
            config.kv_disk_gib,
            loaded.path,
            f"{loaded.quantization}:{str(loaded.dtype).removeprefix('torch.')}",
            CacheIdentity.of(loaded.name, runner.kv_cache),
            disk_claim,
        )
        log.info(
            "kv disk tier open",
            extra={"directory": config.kv_disk_dir, "blocks": len(runner.kv_disk.tier.hashes())},
        )
    if config.device == "cpu":
        budget = memory_budget.measure(loaded.model, runner.kv_cache, loaded.path)
        log.info("memory budget", extra=budget.log_fields())
    for name, path in config.lora_module_paths().items():
        try:
            info = runner.adapters.load(name, Path(path))
        except LLMServeError as exc:  # an adapter we cannot serve stops the start, named
            raise ModelLoadError(f"--lora-modules {name}={path}: {exc}") from exc
        log.info("LoRA adapter loaded at start", extra={"lora_name": name, "rank": info.rank})
    return loaded, runner


def check_memory(config: WorkerConfig, dtype: torch.dtype) -> None:
    """Refuse, before loading anything, a start whose weights + KV cache + runtime exceed the
    memory this process may still take (what it holds already counts as available to it)."""
    path = resolve_model_path(config.model)
    quantization = resolve_quantization(config.quantization, path)
    memory_budget.check_fits(
        weight_bytes=memory_budget.estimated_weight_bytes(path, quantization, dtype),
        kv_cache_bytes=int(config.kv_cache_gib * GiB),
        runtime_bytes=memory_budget.RUNTIME_ESTIMATE_BYTES,
        available=memory_budget.available_bytes() + memory_budget.resident_bytes(),
    )


def log_kernel_path(device: torch.device) -> None:
    """Say which CPU kernels serve: an install without a compiler or a prebuilt library (a
    container image built without its kernels) would otherwise decode several times slower
    on the torch ops, in silence."""
    if device.type != "cpu":
        return
    variant = cpu_extension.loaded_variant()
    if variant is None:
        log.warning(
            "CPU kernels: torch ops (the C++ kernels are not loaded; decode is several times"
            " slower; `llmserve build-kernels` says why)"
        )
    else:
        log.info("CPU kernels: C++", extra={"variant": variant})


async def serve(config: WorkerConfig) -> None:
    service = GrpcService.internal(
        "worker", [SERVICE_NAME, kv_transfer_service.SERVICE_NAME], config.internal_secret
    )
    servicer = WorkerServicer(config)
    service.add(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
    service.add(
        worker_pb2_grpc.add_KvTransferServicer_to_server,
        KvTransferServicer(
            servicer.kv_receiver, servicer.on_forward_thread, config.kv_transfer_shm_dir
        ),
    )
    # Transfer files a crashed worker of this host left behind.
    swept = kv_transfer_shm.sweep(config.kv_transfer_shm_dir)
    if swept:
        log.info("stale kv transfer files removed", extra={"count": swept})
    # Listen first (health NOT_SERVING) so a supervisor sees the port while the model loads.
    port = await service.start(config.host, config.port)
    log.info("worker listening", extra={"address": f"{config.host}:{port}"})
    start_metrics_server(metrics.REGISTRY, config.host, config.metrics_port, "worker")
    try:
        loaded, runner = await servicer.on_forward_thread(load_runner, config)
    except BaseException:
        # A start that fails (a bad model, a taken --kv-disk-dir) stops its server while the
        # loop runs: the error is then the one line the CLI prints, no shutdown noise after.
        await service.server.stop(grace=None)
        raise
    servicer.attach(loaded, runner)
    await service.set_serving()
    log.info(
        "worker serving",
        extra={
            "model": loaded.name,
            "dtype": str(loaded.dtype),
            "quantization": loaded.quantization,
            "kv_cache_dtype": str(runner.kv_cache.spec.dtype),
            "kv_blocks": runner.kv_cache.num_blocks,
        },
    )
    await service.wait_for_signal()
    await service.drain_and_stop(config.drain_s)
    if runner.kv_disk is not None:
        runner.kv_disk.close()  # write the blocks still queued


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("worker", help="run the worker service (model + KV cache)")
    add_config_flags(parser, WorkerConfig)
    parser.set_defaults(
        func=lambda args: run_service(lambda: serve(config_from_args(WorkerConfig, args)))
    )
