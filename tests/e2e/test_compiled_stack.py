"""A stack whose worker replays compiled decode graphs (what a model the fused decode step
cannot run gets outside tests; here the fused step is turned off): greedy output through it
equals the in-process engine's, and its steps really ran compiled."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.llmserve.v1 import text_pb2
from services.contracts.sampling_params import SamplingParams
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List three colors:\n1.", "def add(a, b):\n    return"]
# Buckets 1 and 2: two concurrent requests decode together, a third waits its turn. Exact
# fp32 arithmetic on both sides: inductor's fused elementwise loops round differently from
# the eager ops, which int8 activation rounding (the gguf default) can turn into another token.
COMPILED_FLAGS = [
    "--quantization",
    "gguf-exact",
    "--no-enforce-eager",
    "--no-fused-decode",
    "--max-num-seqs",
    "2",
    "--tokenizer-replicas",
    "1",
]


@pytest.fixture(scope="module")
def compiled_stack() -> Iterator[RunningStack]:
    with e2e_stack(COMPILED_FLAGS) as running:
        yield running
    assert running.returncode == 0


def steps_by_mode(stack: RunningStack) -> dict[str, float]:
    with urllib.request.urlopen(stack.info["metrics"], timeout=10) as response:
        page = response.read().decode()
    counts: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("llmserve_worker_steps_total{"):
            mode = line.split('mode="', 1)[1].split('"', 1)[0]
            counts[mode] = counts.get(mode, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture(scope="module")
def exact_reference_engine():  # type: ignore[no-untyped-def]
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    config = EngineConfig(
        dtype="float32", quantization="gguf-exact", kv_cache_gib=128 / 1024, enforce_eager=True
    )
    return LLMEngine(config)


def test_compiled_worker_gives_the_eager_engines_greedy_ids(
    compiled_stack: RunningStack,
    exact_reference_engine,  # type: ignore[no-untyped-def]
) -> None:
    stub = compiled_stack.text_stub()

    def generate(prompt: str) -> list[int]:
        request = text_pb2.GenerateRequest(
            prompt=prompt, sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=20)
        )
        return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(generate, PROMPTS))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20)
    want = [exact_reference_engine.generate([p], sampling)[0].token_ids for p in PROMPTS]
    assert got == want
    steps = steps_by_mode(compiled_stack)
    # Every decode step of one or two sequences is compiled; prefills are eager.
    assert steps.get("compiled", 0) >= 19, steps
    stats = compiled_stack.wait_all_blocks_free()
    assert stats.num_free_blocks == stats.num_total_blocks
