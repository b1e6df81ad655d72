"""A real stack on loopback ephemeral ports: `llmserve up` with two tokenizer replicas, the
real embedded model in fp32 (to compare with the in-process engine), real gRPC processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest

from services.stack import RunningStack, running_stack

# Its asserts explain themselves as a test module's do (imported from here first).
pytest.register_assert_rewrite("tests.e2e.llm_comply")
from tests.e2e.llm_comply import SHORT_CONTEXT_FLAGS  # noqa: E402


def worker_threads_flags() -> list[str]:
    """With parallel test workers (scripts/test.sh), each one's stack worker gets its share of
    the cores, as tests/conftest.py gives each test worker's torch. Two stacks whose workers
    each run one OpenMP thread per core oversubscribe them: at every parallel region's barrier
    the threads spin while the one they wait for is off the CPU, and a decode step takes many
    times longer (two e2e files side by side on 2 cores: 103 s, 19 s with one thread each)."""
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if num_workers <= 1:
        return []
    return ["--worker-threads", str(max(1, (os.cpu_count() or 1) // num_workers))]


STACK_FLAGS = [
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
    # Every scheduler checks its queues, seats and block refcounts after each step.
    "--debug-checks",
    *worker_threads_flags(),
]
STARTUP_TIMEOUT_S = 300.0


def e2e_stack(extra: list[str] | None = None) -> AbstractContextManager[RunningStack]:
    """The test stack, with `extra` flags; after the block `returncode` is the launcher's."""
    return running_stack([*STACK_FLAGS, *(extra or [])], startup_timeout_s=STARTUP_TIMEOUT_S)


@pytest.fixture(scope="session")
def stack() -> Iterator[RunningStack]:
    with e2e_stack() as running:
        yield running
    assert running.returncode == 0  # a clean SIGTERM shutdown


@pytest.fixture(scope="session")
def short_context_stack() -> Iterator[RunningStack]:
    """The test stack with a 1024-token context, for llm-comply's OpenAI Chat and Anthropic
    groups (tests/e2e/llm_comply.py says why); one per test worker, as `stack`."""
    with e2e_stack(SHORT_CONTEXT_FLAGS) as running:
        yield running
    assert running.returncode == 0


@pytest.fixture(scope="session")
def exact_stack() -> Iterator[RunningStack]:
    """The test stack in exact fp32 arithmetic (`--quantization gguf-exact`), for the tests
    whose greedy answers must not move by a rounding (the test files say why); one per test
    worker, shared by the files that run there."""
    with e2e_stack(["--quantization", "gguf-exact"]) as running:
        yield running
    assert running.returncode == 0


@pytest.fixture(scope="session")
def reference_engine():  # type: ignore[no-untyped-def]
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", kv_cache_gib=128 / 1024, enforce_eager=True))
