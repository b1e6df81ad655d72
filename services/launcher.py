"""`llmserve up`: the whole stack as local processes on loopback.

Starts the worker, the scheduler and N tokenizer replicas, waits until each reports SERVING on
the standard health service, prints the public address, restarts any process that dies, and
on Ctrl-C / SIGTERM stops them front to back (tokenizers drain first) and exits 0.

Tokenizer replicas all bind the public port: gRPC sets SO_REUSEPORT, so the kernel spreads
client connections across them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True, slots=True)
class StackConfig:
    host: str = "127.0.0.1"
    """Where every process listens (loopback by default)."""
    port: int = 50051
    """Public port of the tokenizer tier (0 = any free port)."""
    tokenizer_replicas: int = 1
    """Tokenizer processes sharing the public port."""
    model: str | None = None
    """A .gguf file or HF directory; unset = the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16."""
    kv_cache_gib: float = 1.0
    """Memory for the paged KV cache, GiB."""
    max_num_seqs: int = 128
    """Most sequences in one step."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step."""
    max_waiting_requests: int = 256
    """Waiting-queue bound; beyond it requests fail at once with RESOURCE_EXHAUSTED."""
    worker_threads: int | None = None
    """torch threads in the worker; unset = one per core."""
    startup_timeout_s: float = 300.0
    """How long to wait for every process to become healthy."""
    ready_file: str | None = None
    """Write the addresses and pids as JSON here once ready (for scripts and tests)."""


@dataclass(slots=True)
class Child:
    name: str
    args: list[str]
    address: str
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *self.args], env=env, start_new_session=True
        )
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def healthy(address: str, timeout: float = 1.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
            return bool(response.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def build_children(config: StackConfig) -> list[Child]:
    host = config.host
    worker_port = free_port(host)
    scheduler_port = free_port(host)
    public_port = config.port or free_port(host)
    model = ["--model", config.model] if config.model else []
    worker_args = [
        "worker",
        "--host",
        host,
        "--port",
        str(worker_port),
        "--dtype",
        config.dtype,
        "--kv-cache-gib",
        str(config.kv_cache_gib),
        *model,
    ]
    if config.worker_threads:
        worker_args += ["--threads", str(config.worker_threads)]
    children = [
        Child("worker", worker_args, f"{host}:{worker_port}"),
        Child(
            "scheduler",
            [
                "scheduler",
                "--host",
                host,
                "--port",
                str(scheduler_port),
                "--worker",
                f"{host}:{worker_port}",
                "--max-num-seqs",
                str(config.max_num_seqs),
                "--max-num-batched-tokens",
                str(config.max_num_batched_tokens),
                "--max-waiting-requests",
                str(config.max_waiting_requests),
            ],
            f"{host}:{scheduler_port}",
        ),
    ]
    for index in range(config.tokenizer_replicas):
        children.append(
            Child(
                f"tokenizer-{index}",
                [
                    "tokenizer",
                    "--host",
                    host,
                    "--port",
                    str(public_port),
                    "--scheduler",
                    f"{host}:{scheduler_port}",
                    *model,
                ],
                f"{host}:{public_port}",
            )
        )
    return children


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.children = build_children(config)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._stopping = False

    @property
    def public_address(self) -> str:
        return self.children[-1].address

    def start(self) -> None:
        for child in self.children:
            child.start(self.env)
        deadline = time.monotonic() + self.config.startup_timeout_s
        for child in self.children:
            print(f"llmserve: waiting for {child.name} at {child.address}", file=sys.stderr)
            while not healthy(child.address):
                if not child.alive:
                    raise RuntimeError(f"{child.name} exited during start-up")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{child.name} not healthy after {self.config.startup_timeout_s}s"
                    )
                time.sleep(0.25)
        if self.config.ready_file:
            Path(self.config.ready_file).write_text(json.dumps(self.describe()))
        print(f"llmserve ready: {self.public_address}", flush=True)

    def describe(self) -> dict[str, object]:
        return {
            "public": self.public_address,
            "scheduler": self.children[1].address,
            "worker": self.children[0].address,
            "pids": {c.name: c.process.pid for c in self.children if c.process is not None},
        }

    def supervise(self) -> None:
        """Restart children that die, until asked to stop."""
        while not self._stopping:
            for child in self.children:
                if self._stopping or child.alive:
                    continue
                code = child.process.returncode if child.process else None
                child.restarts += 1
                print(
                    f"llmserve: {child.name} exited ({code}); restart #{child.restarts}",
                    file=sys.stderr,
                )
                # Back off when a child keeps dying right away.
                if time.monotonic() - child.started_at < 5:
                    time.sleep(min(5.0, 0.5 * child.restarts))
                child.start(self.env)
                if self.config.ready_file:
                    Path(self.config.ready_file).write_text(json.dumps(self.describe()))
            time.sleep(0.2)

    def stop(self, *_: object) -> None:
        self._stopping = True

    def shutdown(self, timeout_s: float = 40.0) -> None:
        # Front to back: tokenizers drain their streams, then the scheduler, then the worker.
        for group in (self.children[2:], self.children[1:2], self.children[:1]):
            for child in group:
                if child.alive and child.process is not None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                if child.process is None:
                    continue
                try:
                    child.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    child.process.kill()


def run(config: StackConfig) -> int:
    stack = Stack(config)
    signal.signal(signal.SIGTERM, stack.stop)
    signal.signal(signal.SIGINT, stack.stop)
    try:
        stack.start()
        stack.supervise()
    except (RuntimeError, TimeoutError) as exc:
        print(f"llmserve: {exc}", file=sys.stderr)
        stack.shutdown(timeout_s=5)
        return 1
    stack.shutdown()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from services.common.config_flags import add_config_flags, config_from_args

    parser = subparsers.add_parser("up", help="start the whole stack as local processes")
    add_config_flags(parser, StackConfig)
    parser.set_defaults(func=lambda args: run(config_from_args(StackConfig, args)))
