"""Losing a process under load loses only what ran on it: `llmserve up` with two tokenizer
replicas and two scheduler+worker pairs serves 32 streams at all times (24 gRPC, 8 HTTP, each
lane one connection to the shared ports) while a tokenizer replica, then a scheduler, then a
worker is SIGKILLed, each once the stack has recovered from the one before.

After each kill: the streams that end early are only those on the killed process (the
replica's connections, read from the kernel; the pair named in the error), they end with
UNAVAILABLE (gRPC), an error event (HTTP) or a reset connection (the replica itself), never a
hang; new requests succeed within seconds; the launcher restarts the process and it serves
again. After the load every KV block of every pair is free. The figures are printed (-s).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

NUM_GRPC_LANES = 24
NUM_HTTP_LANES = 8
MAX_NEW_TOKENS = 16
SAMPLING = text_pb2.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
REQUEST_TIMEOUT_S = 60.0
"""A stream still open this long is a hang (a request takes a few seconds under this load)."""
NEW_REQUESTS_OK_S = 5.0
"""After a kill, requests sent this long after it succeed (and the first may take as long as
a request takes on the capacity left: half the pairs, while the other one reloads)."""
FIRST_SUCCESS_S = 30.0
"""After a kill, the first new request has finished, successfully, within this."""
RECOVERY_S = 120.0
"""The launcher's restart, up to serving again (a worker loads the model)."""
# Each lane its own connection (no subchannel shared between channels), reconnecting fast.
LANE_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]


@dataclass
class Outcome:
    lane: int
    door: str
    """grpc or http."""
    started: float
    ended: float
    code: str
    """OK; a gRPC status name; HTTP_<status>; error_event; or the transport error's type."""
    details: str = ""
    client_port: int | None = None
    """The lane's connection's local port, when known (what the replica held)."""

    @property
    def ok(self) -> bool:
        return self.code == "OK"


@dataclass
class Load:
    stack: RunningStack
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    grpc_ports: dict[int, int] = field(default_factory=dict)
    """gRPC lane → its connection's local port, read when the lane connected."""
    stopping: bool = False

    def prompt(self, lane: int, turn: int) -> str:
        return f"Lane {lane}, request {turn}: a few words about the sea."

    async def grpc_lane(self, lane: int, channel: grpc.aio.Channel) -> None:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        turn = 0
        while not self.stopping:
            turn += 1
            started = time.monotonic()
            request = text_pb2.GenerateRequest(prompt=self.prompt(lane, turn), sampling=SAMPLING)
            port = self.grpc_ports.get(lane)
            try:
                num_tokens, finish = 0, ""
                async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
                    num_tokens += len(response.token_ids)
                    finish = response.finish_reason or finish
                code = "OK" if (finish, num_tokens) == ("length", MAX_NEW_TOKENS) else "INCOMPLETE"
                outcome = Outcome(lane, "grpc", started, time.monotonic(), code, finish, port)
            except grpc.aio.AioRpcError as error:
                ended = time.monotonic()
                outcome = Outcome(
                    lane, "grpc", started, ended, error.code().name, error.details() or "", port
                )
            self.outcomes.append(outcome)
            if not outcome.ok:
                await asyncio.sleep(0.05)

    async def http_lane(self, lane: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            turn = 0
            port: int | None = None
            while not self.stopping:
                turn += 1
                started = time.monotonic()
                body = {
                    "model": self.model,
                    "prompt": self.prompt(lane, turn),
                    "max_tokens": MAX_NEW_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                try:
                    code, details, port = await self._http_stream(client, body, port)
                except (httpx.TransportError, httpx.TimeoutException) as error:
                    code, details = type(error).__name__, str(error)
                outcome = Outcome(lane, "http", started, time.monotonic(), code, details, port)
                self.outcomes.append(outcome)
                if not outcome.ok:
                    await asyncio.sleep(0.05)

    async def _http_stream(
        self, client: httpx.AsyncClient, body: dict[str, object], port: int | None
    ) -> tuple[str, str, int | None]:
        async with client.stream("POST", f"{self.stack.http}/completions", json=body) as response:
            stream = response.extensions.get("network_stream")
            if stream is not None:
                port = int(stream.get_extra_info("client_addr")[1])
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return f"HTTP_{response.status_code}", text, port
            text, finish, done = "", "", False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    return "error_event", json.dumps(event["error"]), port
                for choice in event.get("choices", []):
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
            return ("OK" if done and finish == "length" else "INCOMPLETE"), finish, port

    def since(self, moment: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.ended >= moment]

    def first_success_after(self, moment: float) -> Outcome | None:
        """The first request sent after `moment` to succeed (the first to finish)."""
        succeeded = [o for o in self.outcomes if o.ok and o.started >= moment]
        return min(succeeded, key=lambda o: o.ended) if succeeded else None


def own_connections(ports: set[int]) -> set[int]:
    """Local ports of this process's established TCP connections to `ports`."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    }


def served_ports(pid: int, ports: set[int]) -> set[int]:
    """Client ports of the connections process `pid` accepted on `ports`."""
    return {
        c.raddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.laddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    }


def counter_total(url: str, name: str, **labels: str) -> float:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            page = response.read().decode()
    except OSError:  # not listening (yet)
        return 0.0
    total = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == f"{name}_total" and labels.items() <= sample.labels.items():
                total += sample.value
    return total


async def until(condition: Callable[[], object], what: str, timeout_s: float) -> float:
    """Polls `condition` (in a thread: it may block) until truthy; the time it took."""
    started = time.monotonic()
    while not await asyncio.to_thread(condition):
        assert time.monotonic() - started < timeout_s, f"{what} not met after {timeout_s:g} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


@dataclass
class Kill:
    """One kill's figures."""

    name: str
    in_flight_lost: int = 0
    in_flight_kept: int = 0
    new_failed: int = 0
    first_success_s: float = 0.0
    """From the kill until the first request sent after it succeeded."""
    first_success_sent_s: float = 0.0
    """From the kill until the earliest request sent after it that succeeded was sent."""
    recovered_s: float = 0.0
    probes_refused: int = 0
    """Probes on fresh connections refused (a replica bound to the port, not yet ready)."""

    def row(self) -> str:
        in_flight = self.in_flight_lost + self.in_flight_kept
        return (
            f"{self.name:<12} {self.in_flight_lost:>4} of {in_flight:<4} {self.new_failed:>10}"
            f" {self.first_success_sent_s:>6.2f} s {self.first_success_s:>8.2f} s"
            f" {self.recovered_s:>13.1f} s {self.probes_refused:>14}"
        )


HEADER = (
    "killed       streams lost  new failed  new success: first     restarted   probes refused\n"
    "             of in flight              sent    done   serving again   while warming"
)


def test_kill_under_load() -> None:
    started = time.monotonic()
    extra = ["--workers", "2", "--tokenizer-replicas", "2", "--routing", "least_loaded"]
    with e2e_stack(extra) as stack:
        print(f"\nstack ready in {time.monotonic() - started:.1f} s")
        asyncio.run(asyncio.wait_for(scenario(stack), 600))
    assert stack.returncode == 0
    print(f"total {time.monotonic() - started:.1f} s")


async def scenario(stack: RunningStack) -> None:
    info = stack.info
    public_port = int(stack.public.rsplit(":", 1)[1])
    http_port = httpx.URL(stack.http).port
    assert http_port is not None
    door_ports = {public_port, http_port}
    model = (await asyncio.to_thread(httpx.get, f"{stack.http}/models", timeout=10)).json()
    load = Load(stack, model["data"][0]["id"])
    channels: list[grpc.aio.Channel] = []
    for lane in range(NUM_GRPC_LANES):  # one at a time: the new local port is this lane's
        before = own_connections({public_port})
        channel = grpc.aio.insecure_channel(stack.public, options=LANE_OPTIONS)
        await asyncio.wait_for(channel.channel_ready(), 30)
        (load.grpc_ports[lane],) = own_connections({public_port}) - before
        channels.append(channel)
    tasks = [asyncio.create_task(load.grpc_lane(i, c)) for i, c in enumerate(channels)]
    tasks += [
        asyncio.create_task(load.http_lane(NUM_GRPC_LANES + i)) for i in range(NUM_HTTP_LANES)
    ]
    kills: list[Kill] = []
    try:
        await steady(load)
        latencies = sorted(o.ended - o.started for o in load.outcomes if o.ok)
        print(f"one request (median before the kills): {latencies[len(latencies) // 2]:.2f} s")
        print(HEADER)
        for kill in (
            lambda: kill_tokenizer(load, "tokenizer-1", door_ports),
            lambda: kill_pair_process(load, "scheduler-1", pair=1),
            lambda: kill_pair_process(load, "worker-0", pair=0),
        ):
            kills.append(await kill())
            print(kills[-1].row())
            await steady(load)
    finally:
        load.stopping = True
        done, pending = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 10)
        for channel in channels:
            await channel.close()
    assert not pending, f"{len(pending)} lanes still streaming after the load stopped"
    for task in done:
        task.result()

    # No stream hung: every one ended, in bounded time, and only the kills' failed.
    outcomes = load.outcomes
    assert all(o.ended - o.started < REQUEST_TIMEOUT_S for o in outcomes)
    assert not [o for o in outcomes if o.code in ("DEADLINE_EXCEEDED", "INCOMPLETE")]
    assert sum(k.in_flight_lost + k.new_failed for k in kills) == sum(not o.ok for o in outcomes), [
        o for o in outcomes if not o.ok
    ]
    print(f"\n{len(outcomes)} streams, {sum(o.ok for o in outcomes)} succeeded")

    # Every KV block free on every pair (the restarted ones too), once idle.
    for address in stack.schedulers:

        def idle(address: str = address) -> bool:
            stats = stack.stats(address)
            free = stats.num_free_blocks == stats.num_total_blocks - stats.num_pinned_blocks
            return free and stats.num_running == stats.num_waiting == 0

        await until(idle, f"every KV block of {address} free", 10)
    # Nothing restarted but what was killed.
    changed = {name for name, pid in stack.info["pids"].items() if info["pids"][name] != pid}
    assert changed == {k.name for k in kills}


async def steady(load: Load) -> None:
    """Until every lane has finished a request since now (the load is back at full width)."""
    since = time.monotonic()

    def all_lanes_served() -> bool:
        lanes = {o.lane for o in load.outcomes if o.ok and o.started >= since}
        return len(lanes) == NUM_GRPC_LANES + NUM_HTTP_LANES

    await until(all_lanes_served, "every lane served", 60)


def in_flight_at(load: Load, moment: float) -> list[Outcome]:
    return [o for o in load.outcomes if o.started < moment <= o.ended]


async def kill_tokenizer(load: Load, name: str, door_ports: set[int]) -> Kill:
    stack = load.stack
    old_pid = int(stack.info["pids"][name])
    metrics_url = stack.info["process_metrics"][name]
    held = served_ports(old_pid, door_ports)
    assert held, f"{name} holds no lane's connection (the kernel put them all on the other)"
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    kill = Kill(name)

    # Recovery: the launcher restarts it, and it serves (new connections reach it: the
    # lanes stay on theirs, so probes on fresh connections until one lands on it).
    async def probe() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": load.model, "prompt": "Probe:", "max_tokens": 2}
            try:
                response = await client.post(
                    f"{stack.http}/completions", json=body, headers={"connection": "close"}
                )
            except httpx.TransportError:
                return
            kill.probes_refused += response.status_code != 200

    def new_replica_served() -> bool:
        pid = int(stack.info["pids"][name])
        return pid != old_pid and counter_total(metrics_url, "llmserve_requests", code="OK") > 0

    deadline = killed_at + RECOVERY_S
    while not await asyncio.to_thread(new_replica_served):
        assert time.monotonic() < deadline, f"{name} not serving again"
        await probe()
        await asyncio.sleep(0.1)
    kill.recovered_s = time.monotonic() - killed_at
    await settle(load, killed_at, kill)

    # Lost: only the lanes whose connection the killed replica held.
    for outcome in in_flight_at(load, killed_at):
        if outcome.ok:
            kill.in_flight_kept += 1
            continue
        kill.in_flight_lost += 1
        assert outcome.client_port in held, outcome
        assert outcome.code in ("UNAVAILABLE", "RemoteProtocolError", "ReadError"), outcome
    assert kill.in_flight_lost >= 1
    kill.new_failed = check_new_requests(load, killed_at, lambda o: o.client_port in held)
    return kill


async def kill_pair_process(load: Load, name: str, pair: int) -> Kill:
    stack = load.stack
    scheduler = stack.schedulers[pair]
    old_pid = int(stack.info["pids"][name])
    before = await asyncio.to_thread(stack.stats, scheduler)
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    kill = Kill(name)

    def pair_serving() -> bool:
        try:
            stats = stack.stats(scheduler)
        except grpc.RpcError:
            return False  # down, or its worker not connected
        restarted = int(stack.info["pids"][name]) != old_pid
        new_worker = not name.startswith("worker") or stats.worker_epoch != before.worker_epoch
        return restarted and new_worker and stats.num_running > 0

    kill.recovered_s = await until(pair_serving, f"{name} serving again", RECOVERY_S)
    await settle(load, killed_at, kill)

    def names_the_pair(outcome: Outcome) -> bool:
        return outcome.code in ("UNAVAILABLE", "error_event", "HTTP_503") and (
            f"scheduler {scheduler} is unavailable" in outcome.details
        )

    in_flight = in_flight_at(load, killed_at)
    for outcome in in_flight:
        if outcome.ok:
            kill.in_flight_kept += 1
            continue
        kill.in_flight_lost += 1
        assert names_the_pair(outcome), outcome
    # No more than the pair held then (plus what was sent while its stats were read).
    sent_meanwhile = sum(1 for o in in_flight if o.started > killed_at - 1.0)
    assert 1 <= kill.in_flight_lost <= before.num_running + before.num_waiting + sent_meanwhile
    kill.new_failed = check_new_requests(load, killed_at, names_the_pair)
    return kill


async def settle(load: Load, killed_at: float, kill: Kill) -> None:
    """Until every stream in flight at the kill has ended; the first new success's time."""

    def every_lane_moved_on() -> bool:  # a lane sends its next request once one ends
        lanes = {o.lane for o in load.outcomes if o.started >= killed_at}
        return len(lanes) == NUM_GRPC_LANES + NUM_HTTP_LANES

    await until(every_lane_moved_on, "the streams in flight at the kill ended", REQUEST_TIMEOUT_S)
    first = load.first_success_after(killed_at)
    assert first is not None
    kill.first_success_s = first.ended - killed_at
    succeeded = [o.started for o in load.outcomes if o.ok and o.started >= killed_at]
    kill.first_success_sent_s = min(succeeded) - killed_at
    assert kill.first_success_s < FIRST_SUCCESS_S, kill
    assert kill.first_success_sent_s < NEW_REQUESTS_OK_S, kill


def check_new_requests(
    load: Load, killed_at: float, lost_with_it: Callable[[Outcome], bool]
) -> int:
    """Requests sent after the kill that failed: each one the killed process's, and none
    sent once the first new request had succeeded... within FIRST_SUCCESS_S of the kill."""
    failed = [o for o in load.outcomes if o.started >= killed_at and not o.ok]
    for outcome in failed:
        assert lost_with_it(outcome), outcome
        assert outcome.started - killed_at < NEW_REQUESTS_OK_S, outcome
    return len(failed)
