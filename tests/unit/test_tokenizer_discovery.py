"""Schedulers found by DNS, over real gRPC on loopback: fake Engine servers on 127.0.0.x (one
port, as the pods behind a headless Service), a resolver the test controls, and the real
tokenizer server. Warm-up by DNS, pending until healthy, drain on leave, UNAVAILABLE for a
stream cut by the drain."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from protos.llmserve.v1 import scheduler_pb2_grpc, text_pb2, text_pb2_grpc
from services.common.model_description_proto import description_to_proto
from services.tokenizer import metrics
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import ServedModel, TokenizerServer
from tests.unit.tokenizer_tier_harness import FakeEngine, script_for, served_model

TIMEOUT_S = 10.0
HOSTS = ("127.0.0.2", "127.0.0.3")


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


@dataclass
class FakeDns:
    """What the scheduler name resolves to; empty = NXDOMAIN."""

    ips: list[str] = field(default_factory=list)
    num_queries: int = 0

    async def resolve(self, name: str, port: int) -> list[str]:
        self.num_queries += 1
        if not self.ips:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.ips)

    async def answered_twice(self) -> None:
        """Until two more resolutions have happened (the flap guard's threshold)."""
        target = self.num_queries + 2
        await until(lambda: self.num_queries >= target, "two resolutions")


@dataclass
class Discovery:
    server: TokenizerServer
    engines: dict[str, FakeEngine]
    """By IP address."""
    port: int
    dns: FakeDns
    stub: text_pb2_grpc.TextGenerationStub

    def address(self, ip: str) -> str:
        return f"{ip}:{self.port}"

    def states(self) -> dict[str, float]:
        return {
            state: metrics.SCHEDULERS.labels(state)._value.get()
            for state in ("pending", "active", "draining")
        }


async def until(condition: Callable[[], object], what: str) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not condition():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def discovery(
    model: ServedModel, engines: dict[str, FakeEngine], dns: FakeDns, *, warm: bool = True
) -> AsyncIterator[Discovery]:
    """An engine server per IP of `engines`, all on one port; the tokenizer finds them by
    `dns` under dns:pairs.test:PORT."""
    servers, port = [], 0
    for ip, engine in engines.items():
        engine.description = description_to_proto(model.description)
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(engine, server)
        port = server.add_insecure_port(f"{ip}:{port}")
        await server.start()
        servers.append(server)
    config = TokenizerConfig(
        port=0,
        http=False,
        scheduler=f"dns:pairs.test:{port}",
        scheduler_resolve_s=0.05,
        warmup_poll_s=0.02,
        stats_poll_s=0.02,
        drain_s=0.5,
        routing="round_robin",
    )
    tokenizer = TokenizerServer(config, resolve=dns.resolve)
    public_port = await tokenizer.start()
    if warm:
        await asyncio.wait_for(tokenizer.warm_up(), TIMEOUT_S)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{public_port}")
    try:
        yield Discovery(tokenizer, engines, port, dns, text_pb2_grpc.TextGenerationStub(channel))
    finally:
        await channel.close()
        await tokenizer.stop(0)
        for server in servers:
            await server.stop(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def generate(stub: text_pb2_grpc.TextGenerationStub) -> list[text_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(text_pb2.GenerateRequest(prompt="a"), timeout=5)]


def test_first_schedulers_arrive_by_dns_and_join_routing_once_they_answer(
    model: ServedModel,
) -> None:
    a, b = FakeEngine(script_for([42])), FakeEngine(script_for([42]), stats_available=False)
    dns = FakeDns()

    async def scenario() -> None:
        async with discovery(model, dict(zip(HOSTS, (a, b), strict=True)), dns, warm=False) as d:
            warm = asyncio.create_task(d.server.warm_up())
            await dns.answered_twice()  # NXDOMAIN meanwhile: nothing to warm up from
            assert not warm.done() and d.server.pool.clients == []
            dns.ips = [HOSTS[0]]
            await asyncio.wait_for(warm, TIMEOUT_S)
            assert [c.address for c in d.server.pool.routable] == [d.address(HOSTS[0])]
            dns.ips = list(HOSTS)
            await until(lambda: len(d.server.pool.clients) == 2, "B joining")
            await asyncio.sleep(0.2)  # polls go by: B does not answer, so it stays pending
            assert d.states() == {"pending": 1, "active": 1, "draining": 0}
            for _ in range(4):
                await generate(d.stub)
            assert (len(a.requests), len(b.requests)) == (4, 0)
            b.stats_available = True
            await until(lambda: len(d.server.pool.routable) == 2, "B answering")
            for _ in range(4):
                await generate(d.stub)
            assert (len(a.requests), len(b.requests)) == (6, 2)  # round-robin over both

    run(scenario)


def test_a_scheduler_gone_from_dns_drains_then_its_open_stream_ends_unavailable(
    model: ServedModel,
) -> None:
    a = FakeEngine(script_for([42], finish_reason=""), hold_open=True)
    b = FakeEngine(script_for([7]))
    dns = FakeDns(list(HOSTS))

    async def scenario() -> None:
        async with discovery(model, dict(zip(HOSTS, (a, b), strict=True)), dns) as d:
            await until(lambda: len(d.server.pool.routable) == 2, "both answering")
            pool = d.server.pool
            request = text_pb2.GenerateRequest(prompt="a", request_id="held")
            # Round-robin: the first request goes to A, which holds it open.
            held = d.stub.Generate(request, timeout=TIMEOUT_S)
            first = await held.read()
            assert first.token_ids == [42] and len(a.requests) == 1
            dns.ips = [HOSTS[1]]
            await dns.answered_twice()
            assert [c.address for c in pool.clients] == [d.address(HOSTS[1])]
            (leaver,) = pool.draining
            assert leaver.num_in_flight == 1 and not leaver.closed
            assert d.states() == {"pending": 0, "active": 1, "draining": 1}
            for _ in range(3):  # new requests all go to B while A drains
                assert [r.token_ids for r in await generate(d.stub)] == [[7]]
            assert len(a.requests) == 1
            # drain_s later A's channel closes: its stream ends UNAVAILABLE, naming it.
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await held.read()
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"scheduler {d.address(HOSTS[0])} left the pool" in error.value.details()
            await a.cancelled.wait()  # the scheduler learns of the end (frees its blocks)
            await until(lambda: not pool.draining, "A drained")
            assert leaver.closed and leaver.num_in_flight == 0
            assert d.states() == {"pending": 0, "active": 1, "draining": 0}

    run(scenario)


def test_a_leaver_without_streams_closes_at_once_and_dns_failures_keep_the_rest(
    model: ServedModel, caplog: pytest.LogCaptureFixture
) -> None:
    engines = {HOSTS[0]: FakeEngine(script_for([1])), HOSTS[1]: FakeEngine(script_for([2]))}
    dns = FakeDns(list(HOSTS))

    async def scenario() -> None:
        async with discovery(model, engines, dns) as d:
            pool = d.server.pool
            await until(lambda: len(pool.routable) == 2, "both answering")
            dns.ips = []  # NXDOMAIN for a while
            await dns.answered_twice()
            await dns.answered_twice()
            assert len(pool.routable) == 2
            failures = [r for r in caplog.records if "did not resolve" in r.getMessage()]
            assert len(failures) == 1 and failures[0].levelname == "WARNING"
            dns.ips = [HOSTS[0]]
            await dns.answered_twice()
            leaver = pool.draining[0] if pool.draining else None
            await until(lambda: not pool.draining, "B closed")
            assert leaver is None or leaver.closed
            assert [c.address for c in pool.routable] == [d.address(HOSTS[0])]
            assert [r.token_ids for r in await generate(d.stub)] == [[1]]
            left = [r for r in caplog.records if r.getMessage().startswith("scheduler left")]
            assert len(left) == 1 and left[0].levelname == "INFO"

    with caplog.at_level("INFO", logger="services.tokenizer.routing.pool"):
        run(scenario)
