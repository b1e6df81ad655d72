"""Prefix fetch through a real stack (docs/prefix-cache.md): two pairs behind one Redis, routed
round robin so that a prompt sharing a long prefix with the previous one lands on the other
pair. That pair fetches the prefix's blocks from the first pair's pool (ExportKv, shared
memory on one host) instead of computing them: its answer reports them as cached, and its
greedy ids equal those of the pair that holds the prefix itself, in the default mode and in
exact arithmetic. Another tenant's identical prompt finds nothing to fetch."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NEW_TOKENS = 8
PREFIX = "Ship's log. " + " ".join(
    f"Day {i}: wind from the {('north', 'east', 'south', 'west')[i % 4]}, {i * 3} miles made."
    for i in range(24)
)
"""Many full blocks of the embedded model's tokens (about 300)."""


def generate(
    stack: RunningStack, prompt: str, tenant: str = ""
) -> tuple[list[int], text_pb2.Usage]:
    request = text_pb2.GenerateRequest(
        prompt=prompt,
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
        ),
        tenant_id=tenant,
    )
    ids: list[int] = []
    usage = text_pb2.Usage()
    for response in stack.text_stub().Generate(request, timeout=120):
        ids.extend(response.token_ids)
        if response.HasField("usage"):
            usage = response.usage
    return ids, usage


def counter(stack: RunningStack, process: str, name: str, outcome: str) -> float:
    url = stack.info["process_metrics"][process]
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name.removesuffix("_total"):
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("outcome") == outcome
            )
    return 0.0


@pytest.mark.parametrize("mode", ["gguf", "gguf-exact"])
def test_a_prefix_cached_on_one_pair_is_fetched_by_the_other(mode: str) -> None:
    """In the default mode and in exact float32 arithmetic: the fetched blocks are the bytes
    the holder computed, so the answer equals the holder's own from its pool."""
    redis = RedisServer().start()
    flags = ["--workers", "2", "--tokenizer-replicas", "1", "--redis-url", redis.url]
    flags += ["--routing", "round_robin", "--quantization", mode]
    schedulers = ("scheduler-0", "scheduler-1")

    def fetches(stack: RunningStack) -> tuple[float, float]:
        done = sum(counter(stack, s, "llmserve_kv_fetches_total", "done") for s in schedulers)
        sent = sum(counter(stack, s, "llmserve_kv_exports_total", "sent") for s in schedulers)
        return done, sent

    try:
        with e2e_stack(flags) as stack:
            generate(stack, PREFIX + " What was the wind on day 5?")
            # Round robin: the next two go to the other pair (which fetches), then back to
            # the pair that computed the prefix (a hit in its own pool).
            question = PREFIX + " On which day were the most miles made?"
            fetched_ids, fetched_usage = generate(stack, question)
            local_ids, local_usage = generate(stack, question)
            prefix_tokens = (fetched_usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
            done, sent = fetches(stack)
            # Another tenant's prompt hashes under its own salt: no pair holds its prefix,
            # so nothing is fetched for it and nothing counts as cached.
            _, other_usage = generate(stack, question, tenant="other-tenant")
            assert fetches(stack) == (done, sent)
    finally:
        redis.stop()
    assert other_usage.cached_prompt_tokens == 0
    assert fetched_ids == local_ids
    assert done == 1 and sent == 1
    # The fetched blocks count as cached: all of the shared prefix's full blocks but the one
    # holding the question's start.
    assert fetched_usage.cached_prompt_tokens >= prefix_tokens - 2 * BLOCK_SIZE
    assert local_usage.cached_prompt_tokens >= fetched_usage.cached_prompt_tokens


def test_a_prefix_on_the_other_pairs_disk_after_a_restart_is_fetched_from_there(
    tmp_path: Path,
) -> None:
    """After a restart every pool is empty: the prefix is only in the disk tier of the pair
    that computed it, which exports it from there (read and checked like its own disk hit)."""
    redis = RedisServer().start()
    kv_dir = tmp_path / "kv"
    flags = ["--workers", "2", "--tokenizer-replicas", "1", "--redis-url", redis.url]
    flags += ["--routing", "round_robin", "--kv-disk-dir", str(kv_dir)]
    schedulers = ("scheduler-0", "scheduler-1")
    question = PREFIX + " On which day were the most miles made?"
    try:
        with e2e_stack(flags) as first:
            generate(first, PREFIX + " What was the wind on day 5?")
        assert first.returncode == 0  # a graceful stop: the queued blocks were written
        holders = [i for i in (0, 1) if any((kv_dir / f"pair-{i}").glob("[0-9a-f]*"))]
        assert len(holders) == 1
        with e2e_stack(flags) as second:
            if holders[0] == 0:
                generate(second, "Hi.")  # round robin's first turn, pair 0: not the holder
            fetched_ids, fetched_usage = generate(second, question)
            done = sum(counter(second, s, "llmserve_kv_fetches_total", "done") for s in schedulers)
            local_ids, local_usage = generate(second, question)  # the holder: its own disk
    finally:
        redis.stop()
    prefix_tokens = (fetched_usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert done == 1
    assert fetched_usage.cached_prompt_tokens >= prefix_tokens - 2 * BLOCK_SIZE
    assert local_usage.cached_prompt_tokens >= fetched_usage.cached_prompt_tokens
    assert fetched_ids == local_ids
