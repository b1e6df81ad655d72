"""A real stack on loopback ephemeral ports: `llmserve up` with two tokenizer replicas, the
real embedded model in fp32 (to compare with the in-process engine), real gRPC processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos.llmserve.v1 import engine_pb2, engine_pb2_grpc, text_pb2_grpc

STACK_FLAGS = [
    "--port",
    "0",
    "--tokenizer-replicas",
    "2",
    "--dtype",
    "float32",
    "--kv-cache-gib",
    "0.25",
    "--max-num-seqs",
    "32",
    "--max-waiting-requests",
    "32",
    "--metrics-port",  # the merged page's URL is in the ready file ("metrics")
    "0",
    # Eager workers start in seconds; tests/e2e/test_compiled_stack.py runs a compiled one.
    "--enforce-eager",
]


@dataclass
class Stack:
    process: subprocess.Popen[bytes]
    ready_file: Path

    @property
    def info(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self.ready_file.read_text())

    @property
    def public(self) -> str:
        return str(self.info["public"])

    @property
    def scheduler(self) -> str:
        return str(self.info["scheduler"])

    def text_stub(self) -> text_pb2_grpc.TextGenerationStub:
        return text_pb2_grpc.TextGenerationStub(grpc.insecure_channel(self.public))

    def stats(self) -> engine_pb2.EngineStats:
        with grpc.insecure_channel(self.scheduler) as channel:
            return engine_pb2_grpc.EngineStub(channel).GetStats(
                engine_pb2.GetStatsRequest(), timeout=5
            )

    def wait_all_blocks_free(self, timeout_s: float = 1.0) -> engine_pb2.EngineStats:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if idle and stats.num_free_blocks == stats.num_total_blocks:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.02)


def start_stack(tmp_dir: Path, extra: list[str] | None = None) -> Stack:
    ready_file = tmp_dir / "stack.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            *STACK_FLAGS,
            *(extra or []),
            "--ready-file",
            str(ready_file),
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 300
    while not ready_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"llmserve up exited with {process.returncode}")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError("stack not ready after 300 s")
        time.sleep(0.2)
    return Stack(process, ready_file)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("stack"))
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=90) == 0


@pytest.fixture(scope="session")
def reference_engine():  # type: ignore[no-untyped-def]
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=128 << 20, enforce_eager=True))
