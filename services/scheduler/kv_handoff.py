"""Decode side of disaggregation, the calls (docs/disaggregation.md): for each request the core
admitted to await its KV (features/disaggregation.py), ask its prefill scheduler to compute the
prompt and send the blocks to this pair's worker. The prefill pair's first token comes as soon
as it is sampled, the push runs beside it: the KV counts as in place only once this pair's own
worker says it wrote it (KvTransfer.AwaitKv).

A prefix fetch (docs/prefix-cache.md) asks the pair whose cache holds the prefix to export its
blocks (ExportKv: copied out of that pool, nothing computed) to this pair's worker, then waits
for them the same way; the request then prefills the rest of its prompt here.

Any failure (prefill scheduler unreachable or killed, worker refused, a timeout) falls back:
the request prefills here, in the blocks it holds. An aborted request's call is cancelled,
which aborts it on the prefill side too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from protos.llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import internal_channel
from services.common.kv_destination_proto import kv_destination_to_proto
from services.contracts.kv_transfer import KvDestination
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import TokenEvent
from services.contracts.worker_description import WorkerDescription
from services.scheduler import metrics
from services.scheduler.features.disaggregation import Handoff
from services.scheduler.kv_fetch_cost import FetchCost
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillCall:
    """What a decode scheduler sends its prefill scheduler for one request."""

    prefill_scheduler: str
    submit: scheduler_pb2.SubmitRequest
    """The request as it arrived, turned into a one-token prefill (`prefill_call`)."""


@dataclass(frozen=True, slots=True)
class PrefixFetch:
    """Where a request may fetch its prefix's KV from, and how many tokens of it."""

    source: str
    """The scheduler (host:port) whose cache routing found the prefix in."""
    num_prefix_tokens: int
    """Whole blocks, at least one prompt token short of the prompt (the step that computes the
    last prompt token samples the first output token here)."""


def prefix_fetch(request: scheduler_pb2.SubmitRequest, block_size: int) -> PrefixFetch | None:
    """The fetch routing suggested for this request, or None (none suggested, or nothing
    left to fetch once capped)."""
    if not request.prefix_source or block_size <= 0:
        return None
    num_prompt_tokens = len(request.prompt_token_ids)
    num_blocks = min(request.prefix_source_blocks, (num_prompt_tokens - 1) // block_size)
    if num_blocks <= 0:
        return None
    return PrefixFetch(request.prefix_source, num_blocks * block_size)


def disaggregates(sampling: SamplingParams) -> bool:
    """Whether a request may be prefilled on another pair: one choice, no logprobs, no
    grammar (the first token's logprobs and grammar state would have to travel with it)."""
    return sampling.n == 1 and not sampling.logprobs and sampling.structured_output is None


def prefill_call(request: scheduler_pb2.SubmitRequest) -> PrefillCall:
    """The request for its prefill scheduler: the same prompt, adapter, salt and tenant, one
    token (the first, sampled as it would be here)."""
    submit = scheduler_pb2.SubmitRequest()
    submit.CopyFrom(request)
    submit.prefill_scheduler = ""
    submit.sampling.max_new_tokens = 1
    submit.sampling.min_new_tokens = min(submit.sampling.min_new_tokens, 1)
    return PrefillCall(request.prefill_scheduler, submit)


class KvHandoffs:
    def __init__(
        self,
        worker_address: str,
        internal_secret: str | None,
        timeout_s: float,
        wake: Callable[[], None],
    ) -> None:
        self.worker_address = worker_address
        """This pair's worker, as the prefill worker reaches it."""
        self.internal_secret = internal_secret
        self.timeout_s = timeout_s
        self.wake = wake
        self._calls: dict[str, PrefillCall] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stubs: dict[str, scheduler_pb2_grpc.SchedulerStub] = {}
        self._worker: worker_pb2_grpc.KvTransferStub | None = None
        self.fetch_cost = FetchCost()
        self._in_place_at: dict[str, tuple[float, int]] = {}
        """Requests whose KV is in place and whose first decode step is still to come: when
        (perf_counter), and the tokens still to arrive before it (the prefill pair's first)."""

    def register(self, request_id: str, call: PrefillCall) -> None:
        self._calls[request_id] = call

    def start(
        self,
        scheduler: Scheduler,
        handoffs: list[Handoff],
        description: WorkerDescription,
        now: float,
    ) -> None:
        """Call the prefill scheduler of every request admitted to await its KV, for no
        longer than --kv-transfer-timeout-s or what is left of the request's deadline (`now`
        on the scheduler's clock)."""
        for handoff in handoffs:
            call = self._calls.pop(handoff.request_id, None)
            request = scheduler.requests.get(handoff.request_id)
            if request is None or (call is None and not handoff.num_prefix_tokens):
                scheduler.fall_back_to_local_prefill(handoff.request_id)
                continue
            destination = self._destination(handoff, request, description)
            timeout_s = self.timeout_s
            if request.deadline is not None:
                timeout_s = max(0.001, min(timeout_s, request.deadline - now))
            if handoff.num_prefix_tokens:
                fetch = scheduler_pb2.ExportKvRequest(
                    request_id=handoff.request_id,
                    prompt_token_ids=request.prompt_token_ids[: handoff.num_prefix_tokens],
                    kv_destination=kv_destination_to_proto(destination),
                )
                work = self._fetch(scheduler, handoff, fetch, timeout_s, description.worker_epoch)
            else:
                assert call is not None
                submit = scheduler_pb2.SubmitRequest()
                submit.CopyFrom(call.submit)
                submit.kv_destination.CopyFrom(kv_destination_to_proto(destination))
                work = self._run(scheduler, handoff, submit, timeout_s, description.worker_epoch)
            self._tasks[handoff.request_id] = asyncio.create_task(work)

    def _destination(
        self, handoff: Handoff, request: Request, description: WorkerDescription
    ) -> KvDestination:
        return KvDestination(
            worker=self.worker_address,
            first_block=handoff.first_block,
            block_ids=handoff.block_ids,
            model_name=description.model.model_name,
            kv_cache_dtype=description.kv_cache_dtype,
            block_size=description.block_size,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            worker_epoch=description.worker_epoch,
            host_identity=description.host_identity,
        )

    async def _fetch(
        self,
        scheduler: Scheduler,
        handoff: Handoff,
        fetch: scheduler_pb2.ExportKvRequest,
        timeout_s: float,
        worker_epoch: str,
    ) -> None:
        """A prefix fetch: the exporting pair copies the blocks out of its pool on its next
        step and pushes them; they count once this pair's worker has written them."""
        request_id = handoff.request_id
        started = time.perf_counter()
        try:
            await self._stub(handoff.prefill_scheduler).ExportKv(fetch, timeout=timeout_s)
            await self._worker_stub().AwaitKv(
                worker_pb2.AwaitKvRequest(request_id=request_id, worker_epoch=worker_epoch),
                timeout=max(0.001, timeout_s - (time.perf_counter() - started)),
            )
        except grpc.aio.AioRpcError as exc:
            log.info(
                "prefix fetch failed; computing here",
                extra={
                    "request_id": request_id,
                    "source": handoff.prefill_scheduler,
                    "code": exc.code().name,
                    "error": exc.details(),
                },
            )
            metrics.KV_FETCHES.labels("fallback").inc()
            scheduler.fall_back_to_local_prefill(request_id)
        else:
            seconds = time.perf_counter() - started
            num_tokens = len(handoff.block_ids) * (scheduler.config.block_size)
            self.fetch_cost.observe_fetch(num_tokens, seconds)
            scheduler.complete_remote_prefill(request_id, [])
            metrics.KV_FETCHES.labels("done").inc()
            metrics.KV_FETCH_SECONDS.observe(seconds)
            log.info(
                "prefix fetched",
                extra={
                    "request_id": request_id,
                    "source": handoff.prefill_scheduler,
                    "blocks": len(handoff.block_ids),
                    "fetch_ms": seconds * 1000,
                },
            )
        finally:
            self._tasks.pop(request_id, None)
            self.wake()

    async def _run(
        self,
        scheduler: Scheduler,
        handoff: Handoff,
        submit: scheduler_pb2.SubmitRequest,
        timeout_s: float,
        worker_epoch: str,
    ) -> None:
        request_id = handoff.request_id
        started = time.perf_counter()
        try:
            token_ids: list[int] = []
            stub = self._stub(handoff.prefill_scheduler)
            async for response in stub.Submit(submit, timeout=timeout_s):
                token_ids.extend(response.token_ids)
            if not token_ids:
                raise RuntimeError("the prefill scheduler answered no token")
            prefilled = time.perf_counter()
            # What is left of the same timeout: the push started when that token was sampled.
            await self._worker_stub().AwaitKv(
                worker_pb2.AwaitKvRequest(request_id=request_id, worker_epoch=worker_epoch),
                timeout=max(0.001, timeout_s - (prefilled - started)),
            )
            in_place = time.perf_counter()
            scheduler.complete_remote_prefill(request_id, token_ids)
            self._in_place_at[request_id] = (in_place, len(token_ids))
            metrics.REMOTE_PREFILL.labels("done").observe(in_place - started)
            metrics.DISAGG_TTFT.labels("prefill").observe(prefilled - started)
            metrics.DISAGG_TTFT.labels("transfer").observe(in_place - prefilled)
            log.info(
                "remote prefill done",
                extra={
                    "request_id": request_id,
                    "prefill": handoff.prefill_scheduler,
                    "prefill_ms": (prefilled - started) * 1000,
                    "transfer_ms": (in_place - prefilled) * 1000,
                },
            )
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning(
                "remote prefill failed; prefilling here",
                extra={
                    "request_id": request_id,
                    "prefill": handoff.prefill_scheduler,
                    "error": detail,
                },
            )
            metrics.REMOTE_PREFILL.labels("fallback").observe(time.perf_counter() - started)
            scheduler.fall_back_to_local_prefill(request_id)
        finally:
            self._tasks.pop(request_id, None)
            self.wake()

    def on_events(self, events: list[TokenEvent]) -> None:
        """Time the first decode step of each request whose KV came in: the first token
        beyond the prefill pair's (those come out first, at once)."""
        if not self._in_place_at:
            return
        now = time.perf_counter()
        for event in events:
            entry = self._in_place_at.get(event.request_id)
            if entry is None:
                continue
            in_place, remote_tokens = entry
            remote_tokens -= len(event.new_token_ids)
            if remote_tokens < 0:
                metrics.DISAGG_TTFT.labels("first_decode").observe(now - in_place)
            if remote_tokens < 0 or event.request_finished:
                del self._in_place_at[event.request_id]
            else:
                self._in_place_at[event.request_id] = (in_place, remote_tokens)

    def forget(self, request_id: str) -> None:
        """The request ended here (aborted, expired): its prefill call ends too."""
        self._calls.pop(request_id, None)
        self._in_place_at.pop(request_id, None)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def clear(self) -> None:
        """The worker is gone and every request with it: cancel every call."""
        for request_id in [*self._calls, *self._tasks]:
            self.forget(request_id)
        self._in_place_at.clear()

    def _worker_stub(self) -> worker_pb2_grpc.KvTransferStub:
        """This pair's worker, at the address the prefill worker pushes to."""
        if self._worker is None:
            channel = internal_channel(self.worker_address, self.internal_secret, CHANNEL_OPTIONS)
            self._worker = worker_pb2_grpc.KvTransferStub(channel)
        return self._worker

    def _stub(self, address: str) -> scheduler_pb2_grpc.SchedulerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = internal_channel(address, self.internal_secret, CHANNEL_OPTIONS)
            stub = self._stubs[address] = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub
