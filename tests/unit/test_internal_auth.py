"""The internal secret on gRPC (services/common/internal_auth.py): an internal GrpcService
refuses calls without it (unary and streaming alike) and answers those with it, health and
reflection stay open, no secret means an open port, and an internal channel adds the secret to
every call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.llmserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import GrpcService
from services.common.internal_auth import (
    INTERNAL_SECRET_KEY,
    internal_channel,
    internal_metadata,
)

SECRET = "stack-secret-3f9e1a"
WRONG = "not-it-77c2"
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    """Describe answers; Step echoes each plan's step id. Records the metadata it saw."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerDescription:
        self.metadata.append(dict(context.invocation_metadata() or ()))
        return worker_pb2.WorkerDescription(worker_epoch="e1")

    async def Step(
        self,
        request_iterator: AsyncIterator[worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        async for plan in request_iterator:
            yield worker_pb2.StepOutput(step_id=plan.step_id)


Test = Callable[[int, EchoWorker], Awaitable[None]]


def serve(secret: str | None, test: Test) -> None:
    async def main() -> None:
        service = GrpcService.internal("worker", [SERVICE_NAME], secret)
        servicer = EchoWorker()
        service.add(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
        port = await service.start("127.0.0.1", 0)
        try:
            await test(port, servicer)
        finally:
            await service.server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 30))


async def codes(port: int, metadata: Any) -> tuple[grpc.StatusCode, grpc.StatusCode, list[str]]:
    """Describe's and Step's status codes with `metadata`, and their error messages."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        messages: list[str] = []
        try:
            await stub.Describe(worker_pb2.DescribeRequest(), metadata=metadata, timeout=5)
            describe = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            describe, _ = error.code(), messages.append(error.details() or "")
        call = stub.Step(metadata=metadata, timeout=5)
        try:
            await call.write(worker_pb2.StepPlan(step_id=7))
            output = await call.read()
            assert output.step_id == 7
            step = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            step, _ = error.code(), messages.append(error.details() or "")
        except asyncio.InvalidStateError:  # the write raced the refusal
            step = await call.code()
            messages.append(await call.details() or "")
        call.cancel()
        return describe, step, messages


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        ((INTERNAL_SECRET_KEY, WRONG),),
        ((INTERNAL_SECRET_KEY, ""),),
        (("authorization", SECRET),),
    ],
    ids=["none", "wrong", "empty", "another key"],
)
def test_calls_without_the_secret_are_unauthenticated(metadata: Any) -> None:
    async def test(port: int, servicer: EchoWorker) -> None:
        describe, step, messages = await codes(port, metadata)
        assert (describe, step) == (grpc.StatusCode.UNAUTHENTICATED,) * 2
        assert servicer.metadata == []  # the handler never ran
        assert all(WRONG not in m and SECRET not in m for m in messages)

    serve(SECRET, test)


def test_calls_with_the_secret_are_answered() -> None:
    async def test(port: int, servicer: EchoWorker) -> None:
        assert await codes(port, internal_metadata(SECRET)) == (
            grpc.StatusCode.OK,
            grpc.StatusCode.OK,
            [],
        )

    serve(SECRET, test)


def test_no_secret_configured_leaves_the_port_open() -> None:
    async def test(port: int, servicer: EchoWorker) -> None:
        assert (await codes(port, ()))[:2] == (grpc.StatusCode.OK,) * 2

    serve(None, test)


def test_health_and_reflection_stay_open() -> None:
    async def test(port: int, servicer: EchoWorker) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # not warm yet
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = reflection.ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            reply = await call.read()
            await call.done_writing()
            names = {s.name for s in reply.list_services_response.service}
            assert SERVICE_NAME in names

    serve(SECRET, test)


def test_an_internal_channel_adds_the_secret_to_every_call() -> None:
    async def test(port: int, servicer: EchoWorker) -> None:
        async with internal_channel(f"127.0.0.1:{port}", SECRET) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            # The caller's own metadata goes along with the secret.
            answer = await stub.Describe(
                worker_pb2.DescribeRequest(), metadata=(("x-trace", "t1"),), timeout=5
            )
            assert answer.worker_epoch == "e1"
            assert servicer.metadata[-1][INTERNAL_SECRET_KEY] == SECRET
            assert servicer.metadata[-1]["x-trace"] == "t1"
            call = stub.Step(timeout=5)
            await call.write(worker_pb2.StepPlan(step_id=3))
            assert (await call.read()).step_id == 3
            await call.done_writing()
        async with internal_channel(f"127.0.0.1:{port}", WRONG) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await worker_pb2_grpc.WorkerStub(channel).Describe(
                    worker_pb2.DescribeRequest(), timeout=5
                )
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED

    serve(SECRET, test)


def probe_handlers() -> grpc.GenericRpcHandler:
    """A method of each kind that answers with the secret it was sent (raw bytes both ways)."""

    def seen(context: grpc.aio.ServicerContext) -> bytes:
        return dict(context.invocation_metadata() or ()).get(INTERNAL_SECRET_KEY, "").encode()

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return seen(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield seen(context)

    return grpc.method_handlers_generic_handler(
        "test.Probe",
        {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(streaming),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(unary),
            "StreamStream": grpc.stream_stream_rpc_method_handler(streaming),
        },
    )


def test_an_internal_channel_adds_the_secret_to_every_kind_of_call() -> None:
    async def main() -> list[bytes]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((probe_handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with internal_channel(f"127.0.0.1:{port}", SECRET) as channel:
                return [
                    await channel.unary_unary("/test.Probe/UnaryUnary")(b"", timeout=5),
                    *[r async for r in channel.unary_stream("/test.Probe/UnaryStream")(b"")],
                    await channel.stream_unary("/test.Probe/StreamUnary")(iter([b""])),
                    *[r async for r in channel.stream_stream("/test.Probe/StreamStream")(iter([]))],
                ]
        finally:
            await server.stop(0)

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [SECRET.encode()] * 4


def test_internal_metadata_is_empty_without_a_secret() -> None:
    assert internal_metadata(None) == internal_metadata("") == ()
    assert internal_metadata(SECRET) == ((INTERNAL_SECRET_KEY, SECRET),)
