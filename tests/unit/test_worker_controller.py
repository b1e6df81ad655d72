"""The worker takes one controller (services/worker/server.py): while a Step stream is live, a
second one is refused with FAILED_PRECONDITION and the live batch is left alone (no reset, no
abort); once that stream ends, however it ends, the next one is let in. And the scheduler's
side (services/scheduler/step_loop.py): it reports its worker connected only once the worker
has accepted its stream, so a refused scheduler never turns SERVING, and it builds its
scheduler from the worker's Describe answer (its KV blocks and its model's sliding window)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest
import torch

from protos.llmserve.v1 import model_pb2, worker_pb2, worker_pb2_grpc
from services.contracts.step import BatchPlan, StepResult
from services.scheduler.server_config import SchedulerServerConfig
from services.scheduler.step_loop import StepLoop
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.server import WorkerServicer

TIMEOUT_S = 5.0


class FakeRunner:
    """The ModelRunner surface the servicer drives: counts resets, answers each plan (and has
    the cache and batch a KV transfer would read)."""

    last_step_mode = "eager"
    kv_disk = None  # no KV disk tier

    def __init__(self) -> None:
        self.resets = 0
        self.step_ids: list[int] = []
        self.kv_cache = PagedKVCache(KVCacheSpec(1, 1, 8, 16, torch.float32), 1, "cpu")
        self.batch = SimpleNamespace(sequences={})

    def reset(self) -> None:
        self.resets += 1

    def execute(self, plan: BatchPlan) -> StepResult:
        self.step_ids.append(plan.step_id)
        return StepResult(step_id=plan.step_id)


@contextlib.asynccontextmanager
async def worker(runner: FakeRunner) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    servicer = WorkerServicer(WorkerConfig())
    servicer.attach(SimpleNamespace(name="fake"), runner)  # type: ignore[arg-type]
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        await server.stop(0)


async def step(call: grpc.aio.StreamStreamCall, step_id: int) -> int:
    await call.write(worker_pb2.StepPlan(step_id=step_id))
    output = await asyncio.wait_for(call.read(), TIMEOUT_S)
    assert output is not grpc.aio.EOF
    return int(output.step_id)


async def refusal(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(call.read(), TIMEOUT_S)
    return error.value.code()


def run(test: object) -> None:
    asyncio.run(asyncio.wait_for(test, 30))  # type: ignore[arg-type]


def test_a_second_stream_is_refused_and_the_first_runs_on() -> None:
    async def test() -> None:
        runner = FakeRunner()
        async with worker(runner) as stub:
            first = stub.Step()
            assert await step(first, 1) == 1
            second = stub.Step()
            assert await refusal(second) == grpc.StatusCode.FAILED_PRECONDITION
            assert await step(first, 2) == 2  # the live stream never noticed
            assert runner.resets == 1 and runner.step_ids == [1, 2]
            await first.done_writing()

    run(test())


def test_the_stream_is_accepted_before_its_first_plan() -> None:
    # The scheduler waits for this answer before it reports its worker connected.
    async def test() -> None:
        async with worker(FakeRunner()) as stub:
            call = stub.Step()
            await asyncio.wait_for(call.initial_metadata(), TIMEOUT_S)
            assert not call.done()
            await call.done_writing()

    run(test())


async def until_accepted(stub: worker_pb2_grpc.WorkerStub) -> grpc.aio.StreamStreamCall:
    """What a restarted scheduler does: retry a refused stream until one is taken."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        call = stub.Step()
        try:
            await step(call, 10)
            return call
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert time.monotonic() < deadline, "the ended stream was never released"
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("ending", ["half-closed", "cancelled"])
def test_the_next_stream_is_let_in_once_the_first_ends(ending: str) -> None:
    async def test() -> None:
        runner = FakeRunner()
        async with worker(runner) as stub:
            first = stub.Step()
            assert await step(first, 1) == 1
            if ending == "half-closed":  # a scheduler that stopped cleanly
                await first.done_writing()
                assert await first.read() is grpc.aio.EOF
            else:  # a scheduler that died (its connection reset)
                first.cancel()
            second = await until_accepted(stub)
            assert runner.resets == 2  # the new controller starts from an empty batch
            await second.done_writing()

    run(test())


# ---- the scheduler's side -----------------------------------------------------------------


class RefusingWorker(worker_pb2_grpc.WorkerServicer):
    """A worker that has another controller: it describes itself, and refuses Step."""

    def __init__(self) -> None:
        self.num_refused = 0

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerDescription:
        return worker_pb2.WorkerDescription(
            block_size=16,
            num_kv_blocks=64,
            worker_epoch="e1",
            model=model_pb2.ModelDescription(model_name="m", max_model_len=256, vocab_size=100),
        )

    async def Step(
        self,
        request_iterator: AsyncIterator[worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        self.num_refused += 1
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the worker has a controller")
        yield worker_pb2.StepOutput()


def test_a_refused_scheduler_never_reports_its_worker_connected() -> None:
    async def test() -> None:
        refusing = RefusingWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(refusing, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        changes: list[bool] = []
        config = SchedulerServerConfig(worker=f"127.0.0.1:{port}", reconnect_max_s=0.05)
        loop = StepLoop(config, on_connection_change=changes.append)
        task = asyncio.create_task(loop.run())
        try:
            while refusing.num_refused < 3:  # it keeps trying, as a restarted one must
                await asyncio.sleep(0.02)
            assert changes == [] and not loop.connected.is_set()
        finally:
            task.cancel()
            await server.stop(0)

    run(test())


class WindowedWorker(worker_pb2_grpc.WorkerServicer):
    """A worker whose model attends through a 48-token window on every layer; it accepts the
    Step stream and answers each plan."""

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerDescription:
        return worker_pb2.WorkerDescription(
            block_size=16,
            num_kv_blocks=64,
            worker_epoch="e1",
            model=model_pb2.ModelDescription(model_name="m", max_model_len=256, vocab_size=100),
            sliding_window=48,
        )

    async def Step(
        self,
        request_iterator: AsyncIterator[worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        await context.send_initial_metadata(())
        async for plan in request_iterator:
            yield worker_pb2.StepOutput(step_id=plan.step_id)


def test_the_scheduler_is_built_with_the_workers_window() -> None:
    """The window in the worker's Describe answer reaches the scheduler's KV manager."""

    async def test() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(WindowedWorker(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        config = SchedulerServerConfig(worker=f"127.0.0.1:{port}", reconnect_max_s=0.05)
        loop = StepLoop(config)
        task = asyncio.create_task(loop.run())
        try:
            await asyncio.wait_for(loop.connected.wait(), TIMEOUT_S)
            assert loop.scheduler is not None
            assert loop.scheduler.kv.sliding_window == 48
        finally:
            task.cancel()
            await server.stop(0)

    run(test())
