"""Overlapped and serial scheduling through real stacks give the same float32 greedy ids, on
a load that chunks prompts, preempts (a KV cache too small for everyone) and hits the prefix
cache; both free every block at the end."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

# About 23 KV blocks of 16 tokens: eight requests of 20-30-token prompts and 48 new tokens
# need more, so the latest arrivals are preempted and recomputed; a 32-token step budget
# splits every prompt into chunks. Exact fp32 arithmetic: a recomputed prefill rounds its keys
# differently from the decode steps that first wrote them, which int8 activation rounding
# (the gguf default) can turn into another greedy token in either mode.
PRESSURE_FLAGS = [
    "--quantization",
    "gguf-exact",
    "--tokenizer-replicas",
    "1",
    "--kv-cache-gib",
    "0.016",
    "--max-num-batched-tokens",
    "32",
    "--max-num-seqs",
    "8",
]
SHARED = (
    "You are a careful assistant. Answer in one short paragraph, without lists, and say "
    "when you are not sure. "
)
PROMPTS = [
    SHARED + "What is the capital of France?",
    SHARED + "Why is the sky blue?",
    SHARED + "Name a prime number larger than ten.",
    SHARED + "What does a compiler do?",
    "Once upon a time, in a village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "List three colors and one fruit of each color:\n1.",
    "The three laws of thermodynamics, explained simply: first,",
]


def stack_for(mode: str) -> Iterator[RunningStack]:
    with e2e_stack([*PRESSURE_FLAGS, "--scheduling", mode]) as running:
        yield running
    assert running.returncode == 0


@pytest.fixture(scope="module")
def serial_stack() -> Iterator[RunningStack]:
    yield from stack_for("serial")


@pytest.fixture(scope="module")
def overlapped_stack() -> Iterator[RunningStack]:
    yield from stack_for("overlapped")


def greedy_ids(stack: RunningStack) -> list[list[int]]:
    """Every prompt at once (preemption), after one request that caches the shared prefix."""
    stub = stack.text_stub()

    def generate(prompt: str) -> list[int]:
        # The shared-prefix prompts end at once without ignore_eos; the others stop on EOS
        # or at the length limit, whichever comes first.
        sampling = text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=48, ignore_eos=prompt.startswith(SHARED)
        )
        request = text_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
        return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]

    generate(PROMPTS[0])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(generate, PROMPTS))


def test_overlapped_gives_the_serial_greedy_ids_under_pressure(
    serial_stack: RunningStack, overlapped_stack: RunningStack
) -> None:
    serial = greedy_ids(serial_stack)
    overlapped = greedy_ids(overlapped_stack)
    assert overlapped == serial
    for stack in (serial_stack, overlapped_stack):
        stats = stack.wait_all_blocks_free(timeout_s=10)
        assert stats.num_preemptions > 0, "the load was meant to preempt"
        assert stats.prefix_hit_rate > 0, "the shared prefix was meant to hit"
