"""The tokenizer tier's servicer at its edges, over real gRPC against a fake Engine servicer
(tests/unit/tokenizer_tier_harness.py): validation before the scheduler, deadlines, the
scheduler's errors at both doors, queue-full hints, warm-up and round robin."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import httpx
import pytest

from protos.llmserve.v1 import text_pb2
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    MAX_MODEL_LEN,
    TIMEOUT_S,
    FakeEngine,
    rpc_error,
    run,
    running_stack,
    script_for,
    served_model,
)


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


# ---- validation at the edge --------------------------------------------------------------


def _sampling(**fields: Any) -> text_pb2.GenerateRequest:
    return text_pb2.GenerateRequest(prompt="hi", sampling=text_pb2.SamplingParams(**fields))


INVALID_REQUESTS: list[tuple[str, text_pb2.GenerateRequest, str]] = [
    ("no prompt", text_pb2.GenerateRequest(), "prompt:"),
    (
        "prompt and ids",
        text_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]),
        "prompt:",
    ),
    (
        "prompt and messages",
        text_pb2.GenerateRequest(
            prompt="hi", messages=[text_pb2.ChatMessage(role="user", content="x")]
        ),
        "prompt:",
    ),
    (
        "over the context",
        text_pb2.GenerateRequest(prompt="word " * (MAX_MODEL_LEN + 10)),
        "prompt: the prompt has",
    ),
    (
        "id outside the vocabulary",
        text_pb2.GenerateRequest(prompt_token_ids=[1, 10**7]),
        "prompt_token_ids:",
    ),
    ("negative id", text_pb2.GenerateRequest(prompt_token_ids=[-1]), "prompt_token_ids:"),
    (
        "unknown role",
        text_pb2.GenerateRequest(
            messages=[
                text_pb2.ChatMessage(role="user", content="x"),
                text_pb2.ChatMessage(role="wizard", content="y"),
            ]
        ),
        "messages[1].role:",
    ),
    ("max_new_tokens 0", _sampling(max_new_tokens=0), "sampling.max_new_tokens:"),
    (
        "max_new_tokens over the limit",
        _sampling(max_new_tokens=MAX_MODEL_LEN + 1),
        "sampling.max_new_tokens:",
    ),
    ("negative temperature", _sampling(temperature=-0.5), "sampling.temperature:"),
    ("NaN temperature", _sampling(temperature=math.nan), "sampling.temperature:"),
    ("top_p 0", _sampling(top_p=0.0), "sampling.top_p:"),
    ("top_p over 1", _sampling(top_p=1.5), "sampling.top_p:"),
    ("top_k -2", _sampling(top_k=-2), "sampling.top_k:"),
    ("min_p over 1", _sampling(min_p=1.5), "sampling.min_p:"),
    ("repetition_penalty 0", _sampling(repetition_penalty=0.0), "sampling.repetition_penalty:"),
    ("presence_penalty 3", _sampling(presence_penalty=3.0), "sampling.presence_penalty:"),
    ("frequency_penalty -3", _sampling(frequency_penalty=-3.0), "sampling.frequency_penalty:"),
    ("too many stops", _sampling(stop=[f"s{i}" for i in range(17)]), "sampling.stop:"),
    ("stop too long", _sampling(stop=["x" * 257]), "sampling.stop:"),
    ("empty stop", _sampling(stop=["ok", ""]), "sampling.stop:"),
    ("stop id outside vocab", _sampling(stop_token_ids=[10**7]), "sampling.stop_token_ids:"),
    ("logprobs 21", _sampling(logprobs=21), "sampling.logprobs:"),
    ("logprobs negative", _sampling(logprobs=-1), "sampling.logprobs:"),
    ("min_new_tokens over max", _sampling(min_new_tokens=9, max_new_tokens=4), "sampling.min"),
]


def test_invalid_requests_never_reach_the_scheduler(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            for name, request, prefix in INVALID_REQUESTS:
                error = await rpc_error(stack.generate(request))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert error.details().startswith(prefix), (name, error.details())
            other_model = text_pb2.GenerateRequest(prompt="hi", model="gpt-9")
            error = await rpc_error(stack.generate(other_model))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details().startswith("model: unknown model 'gpt-9'")
            assert stack.engine.requests == []

    run(scenario)


# ---- deadlines and errors ------------------------------------------------------------------


def test_deadline_is_passed_to_the_engine_call(model: ServedModel) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode("ok")))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            await stack.generate(text_pb2.GenerateRequest(prompt="a", deadline_ms=3000), None)
            await stack.generate(text_pb2.GenerateRequest(prompt="b", deadline_ms=60_000), 2.0)
            await stack.generate(text_pb2.GenerateRequest(prompt="c"), None)
        by_deadline_ms, by_grpc_deadline, none = engine.time_remaining
        # gRPC encodes the timeout with rounding; allow a few ms over.
        assert by_deadline_ms is not None and 0 < by_deadline_ms <= 3.05
        assert by_grpc_deadline is not None and 0 < by_grpc_deadline <= 2.05
        assert none is None

    run(scenario)


def test_engine_deadline_finish_is_deadline_exceeded(model: ServedModel) -> None:
    engine = FakeEngine(script_for([], finish_reason="deadline"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    run(scenario)


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ],
)
def test_scheduler_errors_keep_their_code(model: ServedModel, code: grpc.StatusCode) -> None:
    engine = FakeEngine(abort_with=(code, "scripted failure"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == code
        assert "scripted failure" in error.details()
        if code == grpc.StatusCode.UNAVAILABLE:
            assert "scheduler 127.0.0.1:" in error.details()

    run(scenario)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_scheduler_errors_reach_http_as_statuses(
    model: ServedModel, code: grpc.StatusCode, status: int
) -> None:
    """The scheduler refuses at Submit: a stream's status waits for its first token, so the
    refusal is the response's status, not an event inside a 200 stream."""
    engine = FakeEngine(abort_with=(code, "scripted failure"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/completions"
            body = {"model": model.name, "prompt": "a", "stream": True}
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                response = await http.post(url, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert "scripted failure" in error["message"]
        assert ("retry-after" in response.headers) == (status == 503)

    run(scenario)


@pytest.mark.parametrize(
    ("metadata", "retry_after"),
    [
        ((("llmserve-reason", "queue_full"), ("grpc-retry-pushback-ms", "2500")), "3"),
        ((("llmserve-reason", "queue_full"), ("grpc-retry-pushback-ms", "40")), "1"),
        ((("llmserve-reason", "queue_full"),), "1"),  # a scheduler without an estimate
    ],
)
def test_a_full_queue_passes_the_retry_hint_on_at_both_doors(
    model: ServedModel, metadata: tuple[tuple[str, str], ...], retry_after: str
) -> None:
    """gRPC: the scheduler's reason and pushback reach the client as trailing metadata.
    HTTP: 429 with Retry-After in whole seconds, rounded up, at least 1."""
    engine = FakeEngine(
        abort_with=(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), abort_metadata=metadata
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/completions"
            body = {"model": model.name, "prompt": "a", "stream": True}
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                response = await http.post(url, json=body)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.trailing_metadata() or ()) == dict(metadata)
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "queue_full"
        assert response.headers["retry-after"] == retry_after

    run(scenario)


def test_a_prompt_that_never_fits_is_told_apart_from_a_full_queue(model: ServedModel) -> None:
    engine = FakeEngine(
        abort_with=(grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 90 blocks, 64 exist"),
        abort_metadata=(("llmserve-reason", "prompt_too_long"),),
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.trailing_metadata() or ()) == {"llmserve-reason": "prompt_too_long"}

    run(scenario)


def test_http_ready_only_once_warm(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model, warm=False) as stack:
            assert stack.server.http is not None
            base = f"http://127.0.0.1:{stack.server.http.port}"
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                assert (await http.get(f"{base}/health")).status_code == 200
                cold = await http.get(f"{base}/ready")
                loading = await http.post(
                    f"{base}/v1/completions", json={"model": model.name, "prompt": "a"}
                )
                await asyncio.wait_for(stack.server.warm_up(), TIMEOUT_S)
                await asyncio.sleep(0.3)  # a stats poll marks the scheduler as answering
                warm = await http.get(f"{base}/ready")
        assert cold.status_code == 503 and cold.headers["retry-after"] == "1"
        assert loading.status_code == 503
        assert "still loading" in loading.json()["error"]["message"]
        assert warm.status_code == 200

    run(scenario)


def test_unreachable_scheduler_is_unavailable(model: ServedModel) -> None:
    async def scenario() -> None:
        # Warm against a live fake, then point the pool at a port nobody listens on.
        async with running_stack(model) as stack:
            await stack.server.pool.close()
            stack.server.pool.entries = ("127.0.0.1:1",)
            stack.server.pool.open()
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "scheduler 127.0.0.1:1" in error.details()

    run(scenario)


def test_requests_go_round_robin(model: ServedModel) -> None:
    engines = [FakeEngine(script_for([42])), FakeEngine(script_for([42]))]

    async def scenario() -> None:
        async with running_stack(model, engines) as stack:
            for _ in range(4):
                await stack.generate(text_pb2.GenerateRequest(prompt="a"))
        assert [len(e.requests) for e in engines] == [2, 2]

    run(scenario)
