"""LoRA adapters on a real stack (embedded model, 2 scheduler+worker pairs): one given at start
(--lora-modules, vLLM's forms), one loaded and unloaded at run time through the HTTP
door; requests name them by `model` through the official openai client and gRPC. The parity
of an adapter's tokens with transformers + peft is tests/model/test_lora_parity.py's; here: the
plumbing, the cache salt, the slots and the load / unload while requests run."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from benchmarks.lora_adapters import write_random_adapter
from protos.llmserve.v1 import lora_pb2, scheduler_pb2, scheduler_pb2_grpc, text_pb2, text_pb2_grpc
from services.common.model_source import embedded_model_path
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

PROMPT = "Write one sentence about the sea."


class Adapters:
    def __init__(self, directory: Path) -> None:
        model = embedded_model_path()
        # Large enough B that greedy output differs from the base's within a few tokens.
        self.start = write_random_adapter(directory / "start", model, rank=8, seed=1, b_scale=0.2)
        self.later = write_random_adapter(
            directory / "later", model, rank=16, seed=2, b_scale=0.2, targets=("q_proj", "v_proj")
        )
        self.too_big = write_random_adapter(directory / "big", model, rank=32, seed=3)


@pytest.fixture(scope="module")
def adapters() -> Iterator[Adapters]:
    with tempfile.TemporaryDirectory(prefix="llmserve-lora-") as name:
        yield Adapters(Path(name))


@pytest.fixture(scope="module")
def stack(adapters: Adapters) -> Iterator[RunningStack]:
    flags = ["--workers", "2", "--tokenizer-replicas", "1", "--max-loras", "2"]
    # Two adapters after one flag, as vLLM takes them: one in vLLM's JSON form, one NAME=PATH
    # (the same file under a second name).
    start = json.dumps({"name": "start", "path": str(adapters.start)})
    flags += ["--max-lora-rank", "16", "--lora-modules", start, f"start-again={adapters.start}"]
    with e2e_stack(flags) as running:
        yield running


def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0)


def chat(
    stack: RunningStack,
    model: str,
    prompt: str = PROMPT,
    tokens: int = 12,
    system: str | None = None,
) -> str:
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    answer = client(stack).chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=tokens,
        temperature=0.0,
    )
    assert answer.model == model
    return answer.choices[0].message.content or ""


def same_weights_alone(stack: RunningStack, first: str, second: str, tokens: int = 12) -> None:
    """Two adapter names holding the same weights give the same greedy answer, each asked
    alone on a prompt neither has cached."""
    system = f"Answer plainly. Conversation {uuid.uuid4().hex}."
    assert chat(stack, first, tokens=tokens, system=system) == chat(
        stack, second, tokens=tokens, system=system
    )


def base_name(stack: RunningStack) -> str:
    return client(stack).models.list().data[0].id


def test_the_adapter_given_at_start_is_listed_and_changes_the_answer(stack: RunningStack) -> None:
    models = {m.id: m for m in client(stack).models.list().data}
    base = base_name(stack)
    assert "start" in models
    assert models["start"].model_extra is not None
    assert models["start"].model_extra.get("parent") == base
    base_answer = chat(stack, base)
    adapter_answer = chat(stack, "start")
    assert adapter_answer != base_answer
    assert chat(stack, "start") == adapter_answer  # greedy: the same again
    # Each scheduler lists it: both workers were given it at start.
    for address in stack.schedulers:
        assert "start" in stats(stack, address).lora_adapters
        assert "start" in scheduler_lora_call(stack, address)
    page = httpx.get(stack.info["metrics"], timeout=10).text
    assert metric(page, "llmserve_scheduler_lora_requests_total", "start") >= 2
    assert metric(page, "llmserve_scheduler_lora_generation_tokens_total", "start") >= 24
    assert metric(page, "llmserve_scheduler_lora_loaded", "start") == 2  # both schedulers
    assert metric(page, "llmserve_scheduler_lora_load_seconds", "start") > 0


def test_one_flag_gave_both_adapters(stack: RunningStack) -> None:
    names = {m.id for m in client(stack).models.list().data}
    assert {"start", "start-again"} <= names
    same_weights_alone(stack, "start-again", "start")


def test_grpc_names_the_adapter_by_model_too(stack: RunningStack) -> None:
    def tokens(model: str) -> list[int]:
        request = text_pb2.GenerateRequest(
            prompt=PROMPT,
            model=model,
            sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
        )
        return [t for r in stack.text_stub().Generate(request, timeout=120) for t in r.token_ids]

    assert tokens("start") != tokens("")
    listed = stack.text_stub().ListModels(text_pb2.ListModelsRequest(), timeout=10)
    parents = {m.name: m.parent for m in listed.models}
    base = base_name(stack)
    assert parents["start"] == base
    assert parents[base] == ""


def test_an_unknown_adapter_is_not_found(stack: RunningStack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        chat(stack, "no-such-adapter")
    assert caught.value.code == "model_not_found"
    assert "no-such-adapter" in caught.value.message
    request = text_pb2.GenerateRequest(prompt=PROMPT, model="no-such-adapter")
    with pytest.raises(grpc.RpcError) as rpc_error:
        list(stack.text_stub().Generate(request, timeout=30))
    assert rpc_error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in (rpc_error.value.details() or "")


def test_load_refuses_an_adapter_over_the_rank_limit_naming_why(
    stack: RunningStack, adapters: Adapters
) -> None:
    answer = httpx.post(
        f"{stack.http}/load_lora_adapter",
        json={"lora_name": "big", "lora_path": str(adapters.too_big)},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert "rank" in answer.text
    assert "big" not in {m.id for m in client(stack).models.list().data}


def test_the_same_prompt_under_two_adapters_shares_no_cached_blocks(
    stack: RunningStack, adapters: Adapters
) -> None:
    ensure_loaded(stack, "later", adapters.later)
    prompt = "Tell me about lighthouses. " * 12  # several full KV blocks

    def cached(model: str) -> int:
        answer = client(stack).completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0.0
        )
        details = answer.usage.prompt_tokens_details if answer.usage else None
        return (details.cached_tokens or 0) if details else 0

    # One scheduler, so the hits are not a matter of routing.
    for model in ("start", "start"):
        cached(model)
    assert cached("start") > 0
    assert cached("later") == 0
    assert cached("later") > 0


def test_load_and_unload_while_requests_run(stack: RunningStack, adapters: Adapters) -> None:
    """Requests on the base, `start` and `later` stream while `during` is loaded and `later`
    unloaded: every one finishes with its tokens; after the unload `later` is refused; loaded
    again, it serves."""
    ensure_loaded(stack, "later", adapters.later)
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def user(model: str, count: int) -> None:
        try:
            for _ in range(count):
                results.setdefault(model, []).append(chat(stack, model, tokens=24))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=user, args=(model, 3))
        for model in ("later", "later", "start", base_name(stack))
    ]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: any("later" in stats(stack, a).active_lora_adapters for a in stack.schedulers)
    )
    # A load while requests run: placed between two steps, usable at once.
    ensure_loaded(stack, "during", adapters.start)
    answer = httpx.post(
        f"{stack.http}/unload_lora_adapter", json={"lora_name": "later"}, timeout=300
    )
    for thread in threads:
        thread.join(timeout=300)
    # The unload waited for the requests that held the adapter; those that came after it
    # may have been refused (404), never broken mid-stream.
    assert answer.status_code == 200, answer.text
    broken = [e for e in errors if not isinstance(e, openai.NotFoundError)]
    assert not broken, broken
    assert len(results.get("start", [])) == 3
    with pytest.raises(openai.NotFoundError):
        chat(stack, "later")
    # `during` holds the same weights as `start`: the same greedy answer, alone or (steps with
    # adapter rows are batch-invariant: docs/determinism.md) as `start` answered in the busy
    # batch above.
    same_weights_alone(stack, "during", "start", tokens=24)
    assert chat(stack, "during", tokens=24) == results["start"][0]
    assert len(set(results["start"])) == 1
    ensure_loaded(stack, "later", adapters.later)
    assert chat(stack, "later")
    for address in stack.schedulers:
        wait_until(lambda a=address: idle(stats(stack, a)))


def test_adapters_never_exceed_the_slots_in_one_step(
    stack: RunningStack, adapters: Adapters
) -> None:
    """--max-loras 2 with three adapters named at once (start, later, third): all requests
    finish (the third adapter waits for a slot instead of failing)."""
    ensure_loaded(stack, "later", adapters.later)
    ensure_loaded(stack, "third", adapters.start)

    async def run_all() -> list[int]:
        async with grpc.aio.insecure_channel(stack.public) as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)

            async def one(model: str, index: int) -> int:
                request = text_pb2.GenerateRequest(
                    prompt=f"{index}: {PROMPT}",
                    model=model,
                    sampling=text_pb2.SamplingParams(
                        temperature=0.0, max_new_tokens=16, ignore_eos=True
                    ),
                )
                return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=300)])

            models = ["start", "later", "third", ""] * 4
            return list(await asyncio.gather(*(one(m, i) for i, m in enumerate(models))))

    assert asyncio.run(run_all()) == [16] * 16
    for address in stack.schedulers:
        assert len(stats(stack, address).active_lora_adapters) <= 2


# ---- helpers ------------------------------------------------------------------------------


def stats(stack: RunningStack, address: str) -> scheduler_pb2.SchedulerStats:
    return stack.stats(address)


def metric(page: str, name: str, lora: str) -> float:
    """The sum over every process of `name`'s samples labelled lora=`lora`."""
    pattern = re.compile(rf"^{name}\{{([^}}]*)\}} (\S+)$", re.MULTILINE)
    return sum(
        float(value) for labels, value in pattern.findall(page) if f'lora="{lora}"' in labels
    )


def idle(stats: scheduler_pb2.SchedulerStats) -> bool:
    """Nothing running or waiting, every KV block free: no request leaked one."""
    return (
        stats.num_running == stats.num_waiting == 0
        and stats.num_free_blocks == stats.num_total_blocks
    )


def ensure_loaded(stack: RunningStack, name: str, path: Path) -> None:
    answer = httpx.post(
        f"{stack.http}/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=120,
    )
    assert answer.status_code in (200, 409), answer.text


def wait_until(condition, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def scheduler_lora_call(stack: RunningStack, address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListLoraAdapters(
            lora_pb2.ListLoraAdaptersRequest(), timeout=10, metadata=stack.internal_metadata
        )
    return [a.name for a in listed.adapters]
