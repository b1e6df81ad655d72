"""Prefill/decode disaggregation through real stacks (docs/disaggregation.md), in exact arithmetic
(`--quantization gguf-exact`, float32) so that greedy ids can be compared bit for bit.

A colocated stack (one `both` pair) answers each prompt first; then a disaggregated stack (one
prefill pair, one decode pair, one thread per worker) must answer the same ids: long prompts
through the prefill pair (its scheduler counts their prompt tokens), short ones on the decode
pair alone. Killing the prefill worker while long prompts are in flight ends each request with
its full answer (the decode pair prefills it) or UNAVAILABLE, none hangs, and every KV block of
the decode pair is free afterwards.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.lora_adapters import write_random_adapter
from protos.llmserve.v1 import text_pb2, worker_pb2, worker_pb2_grpc
from services.common.model_source import embedded_model_path
from services.stack import RunningStack
from services.worker import kv_transfer_shm
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
MIN_PROMPT = 64
COMMON_FLAGS = [
    "--tokenizer-replicas",
    "1",
    "--quantization",
    "gguf-exact",
    "--worker-threads",
    "1",
    "--no-redis",
    "--disaggregate-min-prompt",
    str(MIN_PROMPT),
    # Long prompts are prefilled in several chunks (on the prefill pair, and on the decode
    # pair when it falls back): the blocks go out only after the last one.
    "--max-num-batched-tokens",
    "48",
]
LONG_PROMPTS = [
    f"Story {i}: " + " ".join(f"{word} {i}" for word in ("river", "stone", "lamp", "field")) * 12
    for i in range(4)
]
SHORT_PROMPTS = ["Name three colours.", "What is two plus two?"]
# Shares all but its tail with LONG_PROMPTS[0]: the decode pair holds that prefix once the
# first has run, and the prefill worker sends only the blocks after it.
PREFIX_PROMPT = LONG_PROMPTS[0] + " And that is where the story ends, by the river."
REQUEST_TIMEOUT_S = 120.0
ADAPTER = "probe"
N_CHOICES_KEY = "n=2"


def greedy_ids(stack: RunningStack, prompt: str, model: str = "", tenant: str = "") -> list[int]:
    return greedy_choices(stack, prompt, 1, model=model, tenant=tenant)[0]


def greedy_choices(
    stack: RunningStack, prompt: str, n: int, model: str = "", tenant: str = ""
) -> list[list[int]]:
    """Each choice's ids, in choice order; `model`: a LoRA adapter's name; `tenant`: whose
    cache salt."""
    request = text_pb2.GenerateRequest(
        prompt=prompt,
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, n=n
        ),
        model=model,
        tenant_id=tenant,
    )
    choices: list[list[int]] = [[] for _ in range(n)]
    for response in stack.text_stub().Generate(request, timeout=REQUEST_TIMEOUT_S):
        choices[response.index].extend(response.token_ids)
    return choices


def counter(stack: RunningStack, process: str, name: str) -> float:
    """A counter of one process of the stack (its own /metrics page)."""
    url = stack.info["process_metrics"][process]
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name.removesuffix("_total"):
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return 0.0


def histogram_count(
    stack: RunningStack, process: str, name: str, value: str, label: str = "outcome"
) -> float:
    """Observations of one labelled series of a histogram on one process's /metrics page."""
    url = stack.info["process_metrics"][process]
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_count") and s.labels.get(label) == value
            )
    return 0.0


def shm_files_of(stack: RunningStack) -> list[str]:
    """KV transfer files in /dev/shm made by this stack's workers (named by creator pid)."""
    pids = {str(stack.info["pids"][name]) for name in ("worker-0", "worker-1")}
    return [
        name
        for name in os.listdir(kv_transfer_shm.DEFAULT_DIRECTORY)
        if name.startswith(kv_transfer_shm.PREFIX)
        and name.removeprefix(kv_transfer_shm.PREFIX).split("-")[0] in pids
    ]


def prompt_tokens_admitted(stack: RunningStack, name: str) -> float:
    return counter(stack, name, "llmserve_prompt_tokens_total")


@pytest.fixture(scope="module")
def adapter_flags(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A random LoRA adapter of the embedded model, served as `probe` by both stacks."""
    path = write_random_adapter(
        tmp_path_factory.mktemp("adapter"), embedded_model_path(), rank=8, seed=7, b_scale=0.05
    )
    return ["--lora-modules", f"{ADAPTER}={path}"]


@pytest.fixture(scope="module")
def colocated_ids(adapter_flags: list[str]) -> dict[str, list[int]]:
    with e2e_stack([*COMMON_FLAGS, *adapter_flags, "--workers", "1"]) as stack:
        prompts = [*LONG_PROMPTS, *SHORT_PROMPTS, PREFIX_PROMPT]
        ids = {prompt: greedy_ids(stack, prompt) for prompt in prompts}
        ids[N_CHOICES_KEY] = [t for c in greedy_choices(stack, LONG_PROMPTS[1], 2) for t in c]
        ids[ADAPTER] = greedy_ids(stack, LONG_PROMPTS[2], model=ADAPTER)
    assert stack.returncode == 0
    return ids


@pytest.fixture(scope="module")
def disaggregated(colocated_ids: dict[str, list[int]], adapter_flags: list[str]):  # type: ignore[no-untyped-def]
    del colocated_ids  # one stack at a time on two cores
    flags = [*COMMON_FLAGS, *adapter_flags, "--prefill-pairs", "1", "--decode-pairs", "1"]
    with e2e_stack(flags) as stack:
        assert stack.info["roles"] == ["prefill", "decode"]
        yield stack


def test_greedy_ids_equal_the_colocated_stack(
    colocated_ids: dict[str, list[int]], disaggregated: RunningStack
) -> None:
    stack = disaggregated
    prefill, decode = stack.schedulers
    assert stack.stats(prefill).role == "prefill" and stack.stats(decode).role == "decode"
    before = prompt_tokens_admitted(stack, "scheduler-0")
    for prompt in SHORT_PROMPTS:
        assert greedy_ids(stack, prompt) == colocated_ids[prompt], prompt
    # Short prompts never reach the prefill pair.
    assert prompt_tokens_admitted(stack, "scheduler-0") == before
    for prompt in LONG_PROMPTS:
        ids = greedy_ids(stack, prompt)
        assert len(ids) == NEW_TOKENS
        assert ids == colocated_ids[prompt], prompt
    # Every long prompt was prefilled on the prefill pair, and its KV moved.
    assert prompt_tokens_admitted(stack, "scheduler-0") - before >= len(LONG_PROMPTS) * MIN_PROMPT
    sent = counter(stack, "worker-0", "llmserve_kv_transfer_bytes_total")
    received = counter(stack, "worker-1", "llmserve_kv_transfer_bytes_total")
    assert sent == received > 0
    # Both workers run on this host: every transfer went through a shared-memory file, and
    # none is left behind.
    assert counter(stack, "worker-0", "llmserve_kv_transfers_shm_total") >= len(LONG_PROMPTS)
    assert counter(stack, "worker-1", "llmserve_kv_transfers_shm_total") >= len(LONG_PROMPTS)
    assert shm_files_of(stack) == []
    # The decode side timed each remote prefill, and split its TTFT by phase.
    remote = histogram_count(stack, "scheduler-1", "llmserve_remote_prefill_seconds", "done")
    assert remote >= len(LONG_PROMPTS)
    for phase in ("prefill", "transfer", "first_decode"):
        observed = histogram_count(
            stack, "scheduler-1", "llmserve_disagg_ttft_seconds", phase, label="phase"
        )
        assert observed >= len(LONG_PROMPTS), phase
    for address in (prefill, decode):
        stats = stack.stats(address)
        assert stats.num_free_blocks == stats.num_total_blocks, address
        assert stats.num_running == stats.num_waiting == 0


def test_a_long_prompt_with_two_choices_is_served_by_the_decode_pair(
    colocated_ids: dict[str, list[int]], disaggregated: RunningStack
) -> None:
    stack = disaggregated
    before = prompt_tokens_admitted(stack, "scheduler-0")
    choices = greedy_choices(stack, LONG_PROMPTS[1], 2)
    assert [t for c in choices for t in c] == colocated_ids[N_CHOICES_KEY]
    assert choices[0] == choices[1] and len(choices[0]) == NEW_TOKENS
    # Choices fork from the prompt's last step: the decode pair prefills it itself.
    assert prompt_tokens_admitted(stack, "scheduler-0") == before


def test_a_long_prompt_on_a_lora_adapter_moves_with_its_adapter(
    colocated_ids: dict[str, list[int]], disaggregated: RunningStack
) -> None:
    """The prefill pair computes the prompt with the adapter, the decode pair continues with
    it: the colocated stack's ids, and the blocks moved."""
    stack = disaggregated
    before = counter(stack, "worker-1", "llmserve_kv_transfer_bytes_total")
    ids = greedy_ids(stack, LONG_PROMPTS[2], model=ADAPTER)
    assert ids == colocated_ids[ADAPTER]
    assert ids != colocated_ids[LONG_PROMPTS[2]]  # the adapter changes the answer
    assert counter(stack, "worker-1", "llmserve_kv_transfer_bytes_total") > before


def test_a_tenants_blocks_never_serve_another_tenant(disaggregated: RunningStack) -> None:
    """Tenant A's long prompt moves its blocks under A's salt; the same prompt from tenant B
    finds nothing cached on the decode pair (its prompt moves again, whole)."""
    stack = disaggregated
    prompt = LONG_PROMPTS[3] + " Tenants."
    received = "llmserve_kv_transfer_bytes_total"
    before = counter(stack, "worker-1", received)
    first = greedy_ids(stack, prompt, tenant="tenant-a")
    moved_for_a = counter(stack, "worker-1", received) - before
    second = greedy_ids(stack, prompt, tenant="tenant-b")
    moved_for_b = counter(stack, "worker-1", received) - before - moved_for_a
    assert first == second  # the same prompt, computed twice
    assert moved_for_a > 0 and moved_for_b == moved_for_a


def test_a_prefix_cached_on_the_decode_pair_is_not_sent_again(
    colocated_ids: dict[str, list[int]], disaggregated: RunningStack
) -> None:
    stack = disaggregated
    assert greedy_ids(stack, LONG_PROMPTS[0]) == colocated_ids[LONG_PROMPTS[0]]
    hits_before = counter(stack, "scheduler-1", "llmserve_prefix_cache_hit_tokens_total")
    prefilled_before = prompt_tokens_admitted(stack, "scheduler-0")
    assert greedy_ids(stack, PREFIX_PROMPT) == colocated_ids[PREFIX_PROMPT]
    # The prefill pair computed the prompt; the decode pair kept its cached blocks of it.
    assert prompt_tokens_admitted(stack, "scheduler-0") > prefilled_before
    hits = counter(stack, "scheduler-1", "llmserve_prefix_cache_hit_tokens_total") - hits_before
    assert hits >= 3 * stack.stats(stack.schedulers[1]).block_size


def test_transfers_into_the_decode_worker_need_the_secret_and_a_matching_cache(
    disaggregated: RunningStack,
) -> None:
    stack = disaggregated
    decode_worker = stack.info["workers"][1]
    with grpc.insecure_channel(decode_worker) as channel:
        epoch = (
            worker_pb2_grpc.WorkerStub(channel)
            .Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=stack.internal_metadata)
            .worker_epoch
        )
        stub = worker_pb2_grpc.KvTransferStub(channel)

        def push(header: worker_pb2.KvTransferHeader, secret: bool = True) -> grpc.RpcError:
            chunks = [worker_pb2.KvChunk(header=header)]
            metadata = stack.internal_metadata if secret else None
            with pytest.raises(grpc.RpcError) as refused:
                stub.PushKv(iter(chunks), timeout=10, metadata=metadata)
            return refused.value

        other_model = worker_pb2.KvTransferHeader(
            request_id="x", model_name="another-model", block_size=16, worker_epoch=epoch
        )
        assert push(other_model, secret=False).code() is grpc.StatusCode.UNAUTHENTICATED
        refused = push(other_model)
        assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "model_name" in (refused.details() or "")
        stale = worker_pb2.KvTransferHeader(request_id="x", worker_epoch="a-previous-life")
        refused = push(stale)
        assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "restarted" in (refused.details() or "")


def wait_idle(stack: RunningStack, address: str, timeout_s: float = 10.0) -> tuple[int, int, int]:
    """(free blocks - total blocks, running, waiting) of a scheduler once idle with every
    block free, or when `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stack.stats(address)
        idle = (
            stats.num_free_blocks - stats.num_total_blocks,
            stats.num_running,
            stats.num_waiting,
        )
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            return idle
        time.sleep(0.05)


def test_a_client_gone_during_the_remote_prefill_frees_both_pairs(
    disaggregated: RunningStack,
) -> None:
    stack = disaggregated
    request = text_pb2.GenerateRequest(
        prompt="Once more. " + LONG_PROMPTS[2],
        sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True),
    )
    for timeout_s in (0.05, 0.3, 1.0):  # before, during and after the handoff
        with pytest.raises(grpc.RpcError) as gone:
            for _ in stack.text_stub().Generate(request, timeout=timeout_s):
                pass
        assert gone.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    for address in stack.schedulers:
        assert wait_idle(stack, address) == (0, 0, 0), address


def test_a_killed_prefill_worker_leaves_no_request_hanging_and_no_block_held(
    colocated_ids: dict[str, list[int]], disaggregated: RunningStack
) -> None:
    stack = disaggregated
    decode = stack.schedulers[1]
    # Fresh prompts (no prefix cached on either pair), answered by the colocated stack's
    # arithmetic whether prefilled there or here.
    prompts = [f"Again {i}. " + prompt for i, prompt in enumerate(LONG_PROMPTS)]

    def outcome(prompt: str) -> list[int] | grpc.StatusCode:
        try:
            return greedy_ids(stack, prompt)
        except grpc.RpcError as exc:
            return exc.code()

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(outcome, prompt) for prompt in prompts]
        time.sleep(0.3)  # the prompts are being prefilled or sent
        os.kill(int(stack.info["pids"]["worker-0"]), signal.SIGKILL)
        outcomes = [f.result(timeout=REQUEST_TIMEOUT_S + 10) for f in futures]
    for prompt, result in zip(prompts, outcomes, strict=True):
        if isinstance(result, grpc.StatusCode):
            assert result is grpc.StatusCode.UNAVAILABLE, (prompt, result)
        else:
            assert len(result) == NEW_TOKENS, prompt
    assert any(not isinstance(result, grpc.StatusCode) for result in outcomes), outcomes
    assert wait_idle(stack, decode) == (0, 0, 0)
    # With the prefill pair down (or restarting), long prompts are served by the decode pair,
    # and a fallback's answer is the one the prompt gets again.
    assert greedy_ids(stack, LONG_PROMPTS[0]) == colocated_ids[LONG_PROMPTS[0]]
    index = next(i for i, result in enumerate(outcomes) if not isinstance(result, grpc.StatusCode))
    assert greedy_ids(stack, prompts[index]) == outcomes[index]
