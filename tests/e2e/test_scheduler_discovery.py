"""Schedulers found by DNS while traffic runs: real scheduler+worker pairs on loopback, each
scheduler on its own 127.0.0.x and all on one port (as pods behind a Kubernetes headless
Service), the real tokenizer server in this process and the real embedded model.

Loopback has no DNS record the test could change, so the tokenizer's resolver is the one
thing faked: the test says what `dns:pairs.test:PORT` resolves to. Everything it resolves to
is a real process speaking gRPC.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.common.config_flags import env_name
from services.launcher import free_port, llmserve_command
from services.stack import RunningProcess, wait_serving
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import TokenizerServer
from tests.e2e.conftest import STARTUP_TIMEOUT_S

HOST_A, HOST_B = "127.0.0.2", "127.0.0.3"
SHORT = text_pb2.SamplingParams(temperature=0.0, max_new_tokens=4)
# Long enough to be still running on A when it is killed, seconds after it started.
LONG = text_pb2.SamplingParams(temperature=0.0, max_new_tokens=1024, ignore_eos=True)
RESOLVE_S = 0.2


@dataclass
class Pair:
    """A scheduler on `host`:port and its worker, started together."""

    host: str
    port: int
    secret: str
    metrics_port: int = 0
    processes: list[RunningProcess] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        env = {env_name("internal_secret"): self.secret}
        worker_port = free_port("127.0.0.1")
        self.metrics_port = free_port(self.host)  # it listens on the scheduler's host
        worker = ["worker", "--host", "127.0.0.1", "--port", str(worker_port), "--threads", "1"]
        worker += ["--dtype", "float32", "--kv-cache-gib", "0.25", "--enforce-eager"]
        scheduler = ["scheduler", "--host", self.host, "--port", str(self.port)]
        scheduler += ["--worker", f"127.0.0.1:{worker_port}", "--scheduler-id", self.host]
        scheduler += ["--metrics-port", str(self.metrics_port)]
        for args, address in ((worker, f"127.0.0.1:{worker_port}"), (scheduler, self.address)):
            environ = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
            process = subprocess.Popen(llmserve_command(*args), env=environ)
            self.processes.append(RunningProcess(process, address))

    def wait_serving(self) -> None:
        for process in self.processes:
            wait_serving(process.address, STARTUP_TIMEOUT_S, lambda p=process: p.alive)

    def prompt_tokens(self) -> float:
        """Prompt tokens this scheduler admitted, from its own /metrics."""
        assert all(p.alive for p in self.processes), f"pair {self.host} exited"
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                page = response.read().decode()
        except OSError:  # not listening yet (URLError is an OSError)
            return 0.0
        for family in text_string_to_metric_families(page):
            if family.name == "llmserve_prompt_tokens":
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
        return 0.0

    def kill(self) -> None:
        """SIGKILL, the scheduler first: its connections reset under the streams it serves."""
        for process in reversed(self.processes):
            if process.alive:
                process.process.send_signal(signal.SIGKILL)
            process.stop(10)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop(30)


@contextmanager
def pairs(secret: str) -> Iterator[tuple[Pair, Pair]]:
    """Pairs A and B on one port, both starting now (their model loads overlap)."""
    port = free_port(HOST_A)
    a, b = Pair(HOST_A, port, secret), Pair(HOST_B, port, secret)
    with ExitStack() as stack:
        for pair in (a, b):
            stack.callback(pair.stop)
            pair.start()
        yield a, b


@dataclass
class Dns:
    ips: list[str]

    async def resolve(self, name: str, port: int) -> list[str]:
        assert name == "pairs.test"
        return list(self.ips)


@dataclass
class Outcome:
    started: float
    """time.monotonic() when the request was sent."""
    code: grpc.StatusCode
    details: str = ""


@dataclass
class Traffic:
    """Short requests, one after another on each of `concurrency` lanes, until stopped."""

    stub: text_pb2_grpc.TextGenerationStub
    outcomes: list[Outcome] = field(default_factory=list)
    stopping: bool = False

    async def lane(self, lane: int) -> None:
        turn = 0
        while not self.stopping:
            turn += 1
            prompt = f"Lane {lane}, request {turn}: the capital of France is"
            self.outcomes.append(await generate(self.stub, prompt, SHORT))

    def succeeded(self) -> int:
        return sum(o.code == grpc.StatusCode.OK for o in self.outcomes)


async def generate(
    stub: text_pb2_grpc.TextGenerationStub, prompt: str, sampling: text_pb2.SamplingParams
) -> Outcome:
    started = time.monotonic()
    try:
        finish = ""
        call = stub.Generate(text_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=60)
        async for response in call:
            finish = response.finish_reason or finish
        assert finish in ("length", "stop"), "a stream ended without a finish reason"
        return Outcome(started, grpc.StatusCode.OK)
    except grpc.aio.AioRpcError as error:
        return Outcome(started, error.code(), error.details() or "")


async def until(condition: Callable[[], object], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not met after {timeout_s:g} s"
        await asyncio.sleep(0.1)


def test_pairs_join_and_leave_by_dns_while_traffic_runs() -> None:
    secret = secrets.token_urlsafe(16)
    with pairs(secret) as (a, b):
        a.wait_serving()
        asyncio.run(asyncio.wait_for(scenario(a, b, secret), STARTUP_TIMEOUT_S))


async def scenario(a: Pair, b: Pair, secret: str) -> None:
    dns = Dns([a.host])
    config = TokenizerConfig(
        port=0,
        http=False,
        scheduler=f"dns:pairs.test:{a.port}",
        scheduler_resolve_s=RESOLVE_S,
        internal_secret=secret,
        routing="least_loaded",
    )
    tokenizer = TokenizerServer(config, resolve=dns.resolve)
    port = await tokenizer.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await asyncio.wait_for(tokenizer.warm_up(), 60)
        pool = tokenizer.pool
        assert [c.address for c in pool.routable] == [a.address]
        traffic = Traffic(text_pb2_grpc.TextGenerationStub(channel))
        lanes = [asyncio.create_task(traffic.lane(i)) for i in range(2)]

        # B joins: pending until its worker is connected, then routed to.
        dns.ips = [a.host, b.host]
        await until(lambda: b.address in pool.addresses, "B listed", 10)
        await until(lambda: b.prompt_tokens() > 0, "B serving requests", STARTUP_TIMEOUT_S)
        assert b.address in [c.address for c in pool.routable]

        # Long streams spread over both; then A leaves DNS with some of them in flight.
        longs = [
            asyncio.create_task(generate(traffic.stub, f"Story {i}: once upon a time", LONG))
            for i in range(4)
        ]
        await asyncio.sleep(1.0)  # routed within milliseconds; least loaded: two on each
        dns.ips = [b.host]
        await until(lambda: bool(pool.draining), "A leaving routing", 10)
        left_at = time.monotonic()
        (leaver,) = pool.draining
        assert leaver.address == a.address and leaver.num_in_flight >= 1
        assert [c.address for c in pool.routable] == [b.address]
        num_before = traffic.succeeded()
        await until(lambda: traffic.succeeded() >= num_before + 2, "traffic on B alone", 30)
        assert leaver.num_in_flight >= 1
        a.kill()  # its streams still in flight end UNAVAILABLE, and then its channel closes
        await until(lambda: not pool.draining, "A's streams ended", 30)
        num_after_kill = traffic.succeeded()
        await until(lambda: traffic.succeeded() >= num_after_kill + 4, "traffic after", 30)
        traffic.stopping = True
        await asyncio.wait_for(asyncio.gather(*lanes), 60)
        for task in longs:
            task.cancel()  # those on B may still run: their end is not what this measures
        ended = await asyncio.gather(*longs, return_exceptions=True)
        long_outcomes = [o for o in ended if isinstance(o, Outcome)]
    finally:
        await channel.close()
        await tokenizer.stop(0)

    # A's long streams were cut; nothing else failed, and only with A's name.
    cut = [o for o in long_outcomes if o.code != grpc.StatusCode.OK]
    assert cut, long_outcomes
    failures = [o for o in traffic.outcomes if o.code != grpc.StatusCode.OK] + cut
    for failure in failures:
        assert failure.code == grpc.StatusCode.UNAVAILABLE, failure
        assert f"scheduler {a.address} left the pool" in failure.details, failure
    assert all(o.code == grpc.StatusCode.OK for o in traffic.outcomes if o.started > left_at)
    assert traffic.succeeded() >= 10
