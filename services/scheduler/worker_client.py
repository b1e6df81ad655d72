"""The scheduler's calls to its worker (worker.proto), in the scheduler's own types: the
worker's description, plans out and results in (worker_convert.py maps the messages), and
typed errors instead of gRPC statuses, so the step loop (step_loop.py) sees neither protobuf
nor grpc.

One WorkerClient (one channel) per connection attempt of the step loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc

from protos.llmserve.v1 import lora_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import internal_metadata
from services.common.lora_proto import lora_adapter_info_from_proto
from services.contracts.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    LLMServeError,
    NotFoundError,
)
from services.contracts.lora import LoraAdapterInfo
from services.contracts.step import BatchPlan, StepResult
from services.contracts.structured_output import StructuredOutput
from services.contracts.worker_description import WorkerDescription
from services.scheduler.worker_convert import (
    plan_to_proto,
    prepare_grammar_request,
    result_from_proto,
    worker_description_from_proto,
)

DESCRIBE_TIMEOUT_S = 5.0
# How long the worker may take to accept a Step stream (it resets its batch first).
STEP_ACCEPT_TIMEOUT_S = 30.0
# How long a grammar compile on the worker may take before the request is let in anyway (the
# worker then compiles it with the sequence, on its step).
PREPARE_GRAMMAR_TIMEOUT_S = 30.0
# Reading and placing an adapter: tens of ms for a small one, seconds for a large one on disk.
LORA_TIMEOUT_S = 120.0


class WorkerUnavailable(LLMServeError):
    """The worker is not connected (starting, restarting or gone)."""


class WorkerRefused(WorkerUnavailable):
    """The worker answers but will not be driven by this scheduler: another controller holds
    it, or the secret is wrong. `reason` names the status, so each kind can be told apart."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class LoraAdapterBusy(LLMServeError):
    """The worker will not unload an adapter yet: a sequence it runs still holds it (the
    plan that drops it has not reached the worker)."""


class GrammarNotPrepared(LLMServeError):
    """The worker did not compile a grammar ahead (restarting, slow), for a reason other than
    the spec: the request goes in anyway, and the worker compiles it on its step."""


def _worker_error(exc: grpc.aio.AioRpcError) -> WorkerUnavailable:
    """A failed call as the loop's typed error; its text is the status's, as logged before."""
    refusals = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED)
    if exc.code() in refusals:
        return WorkerRefused(str(exc), exc.code().name)
    return WorkerUnavailable(str(exc))


class StepStream:
    """The one bidirectional Step stream: plans out, results in, in order."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call

    def done(self) -> bool:
        return bool(self._call.done())

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self._call.add_done_callback(lambda _: callback())

    async def write(self, plan: BatchPlan) -> None:
        try:
            await self._call.write(plan_to_proto(plan))
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc

    async def read(self) -> StepResult:
        try:
            output = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc
        if output is grpc.aio.EOF:
            raise WorkerUnavailable("the worker closed the step stream")
        return result_from_proto(output)


class WorkerClient:
    """A channel to the worker and its calls. Every call raises WorkerRefused or
    WorkerUnavailable when it fails (prepare_grammar: see there)."""

    def __init__(self, address: str, internal_secret: str | None) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        # Passed per call rather than by a channel interceptor: an intercepted stream-stream
        # call routes every write and read through an extra queue, on the step loop's path.
        self._metadata = internal_metadata(internal_secret)

    async def describe(self) -> WorkerDescription:
        try:
            message = await self._stub.Describe(
                worker_pb2.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc
        return worker_description_from_proto(message)

    async def open_steps(self) -> StepStream:
        """The Step stream, once the worker has taken it as its controller's (its initial
        metadata, before any plan)."""
        call = self._stub.Step(metadata=self._metadata)
        try:
            await _accepted(call)
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc
        return StepStream(call)

    async def prepare_grammar(self, spec: StructuredOutput) -> None:
        """Has the worker compile a request's grammar ahead (cached per spec). Raises
        InvalidRequestError when the worker refuses the spec, GrammarNotPrepared when the
        call fails otherwise."""
        try:
            await self._stub.PrepareGrammar(
                prepare_grammar_request(spec),
                timeout=PREPARE_GRAMMAR_TIMEOUT_S,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                field, _, message = (exc.details() or "").partition(": ")
                raise InvalidRequestError(field, message) from None
            raise GrammarNotPrepared(str(exc)) from exc

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """Raises InvalidRequestError (the adapter does not fit: the field named),
        AlreadyExistsError, or WorkerUnavailable."""
        request = lora_pb2.LoadLoraAdapterRequest(name=name, path=path)
        message = await self._lora_call(self._stub.LoadLoraAdapter, request)
        return lora_adapter_info_from_proto(message)

    async def unload_lora_adapter(self, name: str) -> None:
        """Raises NotFoundError, LoraAdapterBusy (a running sequence holds it), or
        WorkerUnavailable."""
        await self._lora_call(
            self._stub.UnloadLoraAdapter, lora_pb2.UnloadLoraAdapterRequest(name=name)
        )

    async def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        message = await self._lora_call(
            self._stub.ListLoraAdapters, lora_pb2.ListLoraAdaptersRequest()
        )
        return [lora_adapter_info_from_proto(info) for info in message.adapters]

    async def _lora_call(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return await method(request, timeout=LORA_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            field, _, message = details.partition(": ")
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(field, message) from None
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFoundError("model", message or details) from None
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                raise AlreadyExistsError(details) from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LoraAdapterBusy(details) from None
            raise WorkerUnavailable(str(exc)) from exc

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._channel.close(grace=None)


async def _accepted(call: grpc.aio.StreamStreamCall) -> None:
    """Returns once the worker has taken `call` as its controller's stream (its initial
    metadata); raises its refusal (AioRpcError) or WorkerUnavailable."""
    try:
        await asyncio.wait_for(call.initial_metadata(), STEP_ACCEPT_TIMEOUT_S)
    except TimeoutError as exc:
        raise WorkerUnavailable("the worker did not accept the step stream in time") from exc
    if call.done():
        await call.read()  # a refused call raises its status here
        raise WorkerUnavailable("the worker ended the step stream at once")
