"""One way to run llmserve processes from Python (tests, benchmarks): `running_stack` starts
`llmserve up`, `running_service` one `llmserve <service>`; each is ready once the standard gRPC
health service says SERVING, and is stopped on exit (SIGTERM, a bounded wait, then SIGKILL).

`running_stack` chooses the stack's internal secret and hands it to `llmserve up` through the
environment (as an operator would with LLMSERVE_INTERNAL_SECRET), so a test can call the
Scheduler API itself (`RunningStack.internal_metadata`) and start more services that join the
stack (`running_service(..., env=stack.child_env)`).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc, text_pb2_grpc
from services.common.config_flags import env_name
from services.common.internal_auth import Metadata, internal_metadata
from services.launcher import free_port, llmserve_command

T = TypeVar("T")

HOST = "127.0.0.1"
# A process that is not listening yet refuses the connection; retry it quickly rather than
# with gRPC's default back-off (1 s, growing).
_WAIT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]


def wait_until(
    condition: Callable[[], T | None],
    timeout_s: float,
    message: str = "condition",
    interval_s: float = 0.05,
) -> T:
    """Call `condition` until it returns something truthy and return that; TimeoutError after
    `timeout_s`. For waiting on a state, never for pacing what is measured."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not met after {timeout_s:g} s")
        time.sleep(interval_s)


def wait_serving(address: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Block on the health service's Watch stream until `address` reports SERVING.

    RuntimeError when `alive()` turns false (the process died), TimeoutError after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(address, options=_WAIT_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not alive():
                raise RuntimeError(f"the process serving {address} exited during start-up")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:g} s")
            # Short calls, so a dead process is noticed within a second.
            try:
                for response in stub.Watch(
                    request, timeout=min(1.0, remaining), wait_for_ready=True
                ):
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass  # not listening yet, or this call's time is up: ask again


@dataclass(slots=True)
class RunningProcess:
    """An `llmserve` process started by `running_service` or `running_stack`."""

    process: subprocess.Popen[bytes]
    address: str
    """Where its gRPC services (health included) answer."""
    returncode: int | None = None
    """The exit code, once stopped."""

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.returncode = self.process.returncode
        return self.returncode


@dataclass(slots=True)
class RunningStack(RunningProcess):
    """`llmserve up` once every process reports SERVING; `info` is its ready file."""

    ready_file: Path = field(default_factory=Path)
    internal_secret: str | None = None
    """The secret every internal call of this stack carries."""

    @property
    def internal_metadata(self) -> Metadata:
        """Metadata for a direct call to a scheduler or a worker of this stack."""
        return internal_metadata(self.internal_secret)

    @property
    def child_env(self) -> dict[str, str]:
        """The environment a process joining this stack needs (its internal secret)."""
        if self.internal_secret is None:
            return {}
        return {env_name("internal_secret"): self.internal_secret}

    @property
    def info(self) -> dict[str, Any]:
        """Addresses, pids and metrics URLs (re-read: the launcher rewrites it on a restart)."""
        return dict(json.loads(self.ready_file.read_text()))

    @property
    def public(self) -> str:
        return self.address

    @property
    def http(self) -> str:
        """The OpenAI base URL (http://host:port/v1)."""
        return str(self.info["http"])

    @property
    def scheduler(self) -> str:
        return str(self.info["scheduler"])

    @property
    def schedulers(self) -> list[str]:
        return [str(a) for a in self.info["schedulers"]]

    def text_stub(self, address: str | None = None) -> text_pb2_grpc.TextGenerationStub:
        return text_pb2_grpc.TextGenerationStub(grpc.insecure_channel(address or self.public))

    def stats(self, address: str | None = None) -> scheduler_pb2.SchedulerStats:
        """GetStats of one scheduler (the first by default)."""
        with grpc.insecure_channel(address or self.scheduler) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=5, metadata=self.internal_metadata
            )

    def wait_all_blocks_free(self, timeout_s: float = 1.0) -> scheduler_pb2.SchedulerStats:
        """The first scheduler's stats once it is idle with every KV block free, or its stats
        when `timeout_s` has passed (for the caller to assert on)."""

        def idle() -> scheduler_pb2.SchedulerStats | None:
            stats = self.stats()
            free = stats.num_free_blocks == stats.num_total_blocks
            return stats if free and stats.num_running == stats.num_waiting == 0 else None

        try:
            return wait_until(idle, timeout_s, "all blocks free", interval_s=0.02)
        except TimeoutError:
            return self.stats()

    def kill_children(self) -> None:
        """SIGKILL whatever the launcher started and left behind (each runs in its own session,
        so killing the launcher alone would leave them holding their ports)."""
        if not self.ready_file.exists():
            return
        for pid in self.info["pids"].values():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _popen(
    args: list[str], stderr: int | IO[bytes] | None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(llmserve_command(*args), env=full_env, stderr=stderr)


@contextmanager
def running_service(
    args: list[str],
    port: int,
    startup_timeout_s: float = 120.0,
    stop_timeout_s: float = 60.0,
    stderr: int | IO[bytes] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[RunningProcess]:
    """`llmserve <args>` listening on `port` of loopback (args must say so), once SERVING;
    `env` is added to this process's environment (e.g. a stack's `child_env`)."""
    running = RunningProcess(_popen(args, stderr, env), f"{HOST}:{port}")
    try:
        wait_serving(running.address, startup_timeout_s, lambda: running.alive)
        yield running
    finally:
        running.stop(stop_timeout_s)


@contextmanager
def running_stack(
    flags: list[str],
    startup_timeout_s: float = 600.0,
    stop_timeout_s: float = 90.0,
    stderr: int | IO[bytes] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[RunningStack]:
    """`llmserve up <flags>` on a free public port, once the public address and every
    scheduler and worker in its ready file report SERVING. After the block `returncode` holds
    the launcher's exit code (0 after a clean SIGTERM shutdown). `env` is added to the
    launcher's environment; its internal secret is `env`'s LLMSERVE_INTERNAL_SECRET, else a
    fresh one."""
    secret_variable = env_name("internal_secret")
    env = dict(env or {})
    env[secret_variable] = env.get(secret_variable) or secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="llmserve-stack-") as directory:
        ready_file = Path(directory) / "ready.json"
        port = free_port(HOST)
        command = ["up", *flags, "--port", str(port), "--ready-file", str(ready_file)]
        if "--http-port" not in flags and "--no-http" not in flags:
            command += ["--http-port", str(free_port(HOST))]  # never the default 8000
        running = RunningStack(
            _popen(command, stderr, env),
            f"{HOST}:{port}",
            ready_file=ready_file,
            internal_secret=env[secret_variable],
        )
        try:
            deadline = time.monotonic() + startup_timeout_s

            def alive() -> bool:
                return running.alive

            def ready_file_written() -> bool:
                if not running.alive:
                    raise RuntimeError(f"llmserve up exited with {running.process.returncode}")
                return ready_file.exists()

            if "--tls-cert" not in flags:  # (over TLS, the launcher's own check is the one)
                wait_serving(running.public, startup_timeout_s, alive)
            # The launcher writes the file once it has seen every process healthy too.
            wait_until(ready_file_written, deadline - time.monotonic(), "the ready file")
            for address in [*running.info["workers"], *running.info["schedulers"]]:
                wait_serving(str(address), deadline - time.monotonic(), alive)
            yield running
        finally:
            if running.stop(stop_timeout_s) == -signal.SIGKILL:
                running.kill_children()
