"""The tokenizer tier under test over real gRPC on loopback: a fake Engine servicer that
streams scripted token ids, a running tier in front of it, and helpers for the tests
(tests/unit/test_tokenizer_server*.py). The tokenizer is the embedded model's real one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llmserve.v1 import model_pb2, scheduler_pb2, scheduler_pb2_grpc, text_pb2, text_pb2_grpc
from services.common.model_description_proto import description_to_proto
from services.common.model_source import embedded_model_path
from services.text.model_tokenizer import ModelTokenizer
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import SERVICE_NAME, ServedModel, TokenizerServer

MAX_MODEL_LEN = 128
TIMEOUT_S = 10.0


def served_model() -> ServedModel:
    """What the tokenizer tier builds from the fake scheduler's Describe answer."""
    tokenizer = ModelTokenizer.from_path(embedded_model_path())
    # A short context keeps the over-length test cheap; vocab as in the model file.
    description = tokenizer.describe(
        model_name="SmolLM2-135M-Instruct",
        vocab_size=tokenizer.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=(),
    )
    return ServedModel.from_description(description)


# ---- the fake scheduler -----------------------------------------------------------------


@dataclass
class FakeEngine(scheduler_pb2_grpc.SchedulerServicer):
    """Streams `script` for every Submit and records what it saw."""

    script: list[scheduler_pb2.SubmitResponse] = field(default_factory=list)
    hold_open: bool = False
    """After the script, keep the stream open until the caller cancels."""
    abort_with: tuple[grpc.StatusCode, str] | None = None
    abort_metadata: tuple[tuple[str, str], ...] = ()
    """Trailing metadata sent with `abort_with`."""
    fail_after_script: tuple[grpc.StatusCode, str] | None = None
    """After the script, end the stream with this status."""
    stats_available: bool = True
    stats_delay_s: float = 0.0
    """GetStats answers after this long (a busy scheduler)."""
    description: model_pb2.ModelDescription | None = None
    """What Describe answers (running_stack sets the served model's)."""
    requests: list[scheduler_pb2.SubmitRequest] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        if self.abort_with is not None:
            context.set_trailing_metadata(self.abort_metadata)
            await context.abort(*self.abort_with)
        finished = False

        def on_done(_: Any) -> None:
            # The RPC ended before the script did: the caller cancelled. (A servicer suspended
            # at `yield` never sees CancelledError, and context.cancelled() stays False here.)
            if not finished:
                self.cancelled.set()

        context.add_done_callback(on_done)
        for response in self.script:
            yield response
            await asyncio.sleep(0)
        if self.hold_open:
            await asyncio.sleep(3600)
        finished = True
        if self.fail_after_script is not None:
            await context.abort(*self.fail_after_script)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        if self.stats_delay_s:
            await asyncio.sleep(self.stats_delay_s)
        if not self.stats_available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        return scheduler_pb2.SchedulerStats(scheduler_id="fake", num_free_blocks=100)

    async def Describe(
        self, request: model_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.ModelDescription:
        if not self.stats_available or self.description is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        assert self.description is not None
        return self.description


def script_for(
    token_ids: Sequence[int],
    *,
    chunk: int = 1,
    finish_reason: str = "length",
    num_prompt_tokens: int = 0,
    num_cached_tokens: int = 0,
    queue_ms: float = 0.0,
) -> list[scheduler_pb2.SubmitResponse]:
    """One message per `chunk` ids; the last one carries finish_reason (if any)."""
    ids = list(token_ids)
    messages = [
        scheduler_pb2.SubmitResponse(token_ids=ids[i : i + chunk])
        for i in range(0, len(ids), chunk)
    ]
    messages = messages or [scheduler_pb2.SubmitResponse()]
    messages[0].queue_ms = queue_ms
    messages[0].num_prompt_tokens = num_prompt_tokens
    messages[0].num_cached_tokens = num_cached_tokens
    messages[-1].finish_reason = finish_reason
    return messages


# ---- the stack under test ---------------------------------------------------------------


@dataclass
class Stack:
    address: str
    server: TokenizerServer
    engines: list[FakeEngine]
    channel: grpc.aio.Channel
    stub: text_pb2_grpc.TextGenerationStub
    health: health_pb2_grpc.HealthStub

    @property
    def engine(self) -> FakeEngine:
        return self.engines[0]

    async def generate(
        self, request: text_pb2.GenerateRequest, timeout: float | None = TIMEOUT_S
    ) -> list[text_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(request, timeout=timeout)]

    async def health_status(self) -> int:
        answer = await self.health.Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S
        )
        return int(answer.status)


@contextlib.asynccontextmanager
async def running_stack(
    model: ServedModel, engines: Sequence[FakeEngine] = (), *, warm: bool = True, **config: Any
) -> AsyncIterator[Stack]:
    engines = list(engines) or [FakeEngine()]
    engine_servers = []
    addresses = []
    for engine in engines:
        if engine.description is None:
            engine.description = description_to_proto(model.description)
        engine_server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(engine, engine_server)
        addresses.append(f"127.0.0.1:{engine_server.add_insecure_port('127.0.0.1:0')}")
        await engine_server.start()
        engine_servers.append(engine_server)
    config = {"http_port": 0, **config}
    tokenizer_config = TokenizerConfig(
        port=0, scheduler=",".join(addresses), warmup_poll_s=0.02, **config
    )
    server = TokenizerServer(tokenizer_config)
    port = await server.start()
    if warm:
        await asyncio.wait_for(server.warm_up(), TIMEOUT_S)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Stack(
            f"127.0.0.1:{port}",
            server,
            engines,
            channel,
            text_pb2_grpc.TextGenerationStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )
    finally:
        await channel.close()
        await server.stop(0)
        for engine_server in engine_servers:
            await engine_server.stop(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


def joined_text(responses: Sequence[text_pb2.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def joined_ids(responses: Sequence[text_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def rpc_error(awaitable: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value
