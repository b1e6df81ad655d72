"""Per-key limits at a real tokenizer tier (scripted scheduler) over real HTTP and gRPC: rpm,
max_concurrent and tpm refusals at every door (429 + Retry-After + the x-ratelimit-* headers;
RESOURCE_EXHAUSTED + the retry pushback), a key without limits untouched, and two tiers
sharing one real Redis seeing one count per key. The limiter's clock is frozen inside one
window, so a minute boundary never resets a count mid-test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from protos.llmserve.v1 import scheduler_pb2, text_pb2
from services.tokenizer import metrics
from services.tokenizer.access.limits import WINDOW_S, window_index
from tests.redis_server import RedisServer
from tests.unit.tokenizer_tier_harness import (
    TIMEOUT_S,
    FakeEngine,
    ServedModel,
    Stack,
    rpc_error,
    run,
    running_stack,
    script_for,
    served_model,
)

RPM_KEY = "sk-rpm-0123456789"
CONCURRENT_KEY = "sk-concurrent-0123456789"
TPM_KEY = "sk-tpm-0123456789"
FREE_KEY = "sk-free-0123456789"
KEYS = (RPM_KEY, CONCURRENT_KEY, TPM_KEY, FREE_KEY)
TPM = 20
NOW = window_index(2_000_000_000.0) * WINDOW_S + 5.0
"""Five seconds into a window: 55 s until it resets."""


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


@dataclass
class Engine(FakeEngine):
    """Holds open the calls that arrive while `hold_open` is set (one token, then nothing);
    the others get two tokens and stop."""

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        self.requests.append(request)
        hold = self.hold_open
        finished = False

        def on_done(_: Any) -> None:
            if not finished:
                self.cancelled.set()

        context.add_done_callback(on_done)
        script = script_for([42], finish_reason="") if hold else self.script
        for response in script:
            yield response
            await asyncio.sleep(0)
        if hold:
            await asyncio.sleep(3600)
        finished = True


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(
        f"{RPM_KEY} rpm=3\n"
        f"{CONCURRENT_KEY} max_concurrent=1\n"
        f"{TPM_KEY} tpm={TPM} rpm=100\n"
        f"{FREE_KEY}\n"
    )
    return str(path)


@contextlib.asynccontextmanager
async def tier(
    model: ServedModel, engine: FakeEngine, key_file: str, **config: Any
) -> AsyncIterator[Stack]:
    async with running_stack(model, [engine], api_key_file=key_file, **config) as stack:
        stack.server.limiter.clock = lambda: NOW
        yield stack


def base_url(stack: Stack) -> str:
    assert stack.server.http is not None
    return f"http://127.0.0.1:{stack.server.http.port}/v1"


async def complete(
    http: httpx.AsyncClient, stack: Stack, key: str, **fields: Any
) -> httpx.Response:
    body = {"model": stack.server.generator.model.name, "prompt": "hi", **fields}
    headers = {"Authorization": f"Bearer {key}"}
    return await http.post(f"{base_url(stack)}/completions", json=body, headers=headers)


async def message(http: httpx.AsyncClient, stack: Stack, key: str) -> httpx.Response:
    body = {
        "model": stack.server.generator.model.name,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return await http.post(f"{base_url(stack)}/messages", json=body, headers={"x-api-key": key})


def generate_call(stack: Stack, key: str) -> Any:
    metadata = (("authorization", f"Bearer {key}"),)
    request = text_pb2.GenerateRequest(prompt="hi")
    return stack.stub.Generate(request, metadata=metadata, timeout=TIMEOUT_S)


async def generate(stack: Stack, key: str) -> list[text_pb2.GenerateResponse]:
    return [response async for response in generate_call(stack, key)]


async def until(condition: Callable[[], Any], what: str, timeout_s: float = 5.0) -> Any:
    """Poll `condition` (a coroutine function) until it returns something truthy."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (answer := await condition()):
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)
    return answer


def refused_count(limit: str) -> float:
    value = metrics.REGISTRY.get_sample_value("llmserve_rate_limited_total", {"limit": limit})
    return value or 0.0


def assert_no_key_in(text: str) -> None:
    for key in KEYS:
        assert key not in text


def test_rpm_at_every_door(model: ServedModel, key_file: str) -> None:
    engine = FakeEngine(script_for([5, 6], finish_reason="stop"))

    async def scenario() -> None:
        refused_before = refused_count("rpm")
        async with (
            tier(model, engine, key_file) as stack,
            httpx.AsyncClient(timeout=TIMEOUT_S) as http,
        ):
            first = await complete(http, stack, RPM_KEY)
            assert first.status_code == 200, first.text
            assert first.headers["x-ratelimit-limit-requests"] == "3"
            assert first.headers["x-ratelimit-remaining-requests"] == "2"
            assert first.headers["x-ratelimit-reset-requests"] == "55s"
            assert "x-ratelimit-limit-tokens" not in first.headers  # no tpm on this key
            await generate(stack, RPM_KEY)  # one count across the doors
            streamed = await complete(http, stack, RPM_KEY, stream=True)
            assert streamed.status_code == 200, streamed.text
            assert streamed.headers["x-ratelimit-remaining-requests"] == "0"

            over = await complete(http, stack, RPM_KEY)
            assert over.status_code == 429, over.text
            error = over.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert "rpm" in error["message"]
            assert over.headers["retry-after"] == "55"
            assert over.headers["x-ratelimit-remaining-requests"] == "0"
            assert over.headers["x-ratelimit-reset-requests"] == "55s"
            assert_no_key_in(over.text + str(over.headers))

            anthropic = await message(http, stack, RPM_KEY)
            assert anthropic.status_code == 429, anthropic.text
            assert anthropic.json()["error"]["type"] == "rate_limit_error"
            assert anthropic.headers["retry-after"] == "55"
            assert anthropic.headers["x-ratelimit-limit-requests"] == "3"

            rpc = await rpc_error(generate(stack, RPM_KEY))
            assert rpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rpm" in (rpc.details() or "")
            trailers = dict(rpc.trailing_metadata() or ())
            assert trailers["llmserve-reason"] == "rate_limited"
            assert trailers["grpc-retry-pushback-ms"] == "55000"
            assert_no_key_in(str(rpc.details()))

            # A key without limits: served, and no rate-limit headers.
            for _ in range(5):
                free = await complete(http, stack, FREE_KEY)
                assert free.status_code == 200, free.text
                assert not any(h.startswith("x-ratelimit") for h in free.headers)
            await generate(stack, FREE_KEY)
        # The three refusals (OpenAI, Anthropic, gRPC) were refused before any scheduler call.
        assert len(engine.requests) == 3 + 6
        assert refused_count("rpm") - refused_before == 3

    run(scenario)


def test_max_concurrent_refuses_while_a_stream_is_open(model: ServedModel, key_file: str) -> None:
    engine = Engine(script_for([5, 6], finish_reason="stop"))

    async def scenario() -> None:
        async with tier(model, engine, key_file) as stack:
            await max_concurrent_scenario(stack, stack, engine)

    run(scenario)


async def max_concurrent_scenario(holder: Stack, other: Stack, engine: FakeEngine) -> None:
    """`holder` holds a stream open for the max_concurrent=1 key; `other` refuses the key's
    next request at both doors, then serves one once the stream is gone. `engine` (an Engine)
    serves `holder`."""
    refused_before = refused_count("max_concurrent")
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        # An HTTP stream held open, its first chunk read (its status is decided).
        body = {"model": holder.server.generator.model.name, "prompt": "hi", "stream": True}
        headers = {"Authorization": f"Bearer {CONCURRENT_KEY}"}
        url = f"{base_url(holder)}/completions"
        engine.hold_open = True
        async with http.stream("POST", url, json=body, headers=headers) as held:
            assert held.status_code == 200
            chunks = held.aiter_bytes()  # kept: a dropped iterator closes the connection
            await anext(chunks)
            engine.hold_open = False
            over = await complete(http, other, CONCURRENT_KEY)
            assert over.status_code == 429, over.text
            assert "max_concurrent" in over.json()["error"]["message"]
            assert over.headers["retry-after"] == "1"
            rpc = await rpc_error(generate(other, CONCURRENT_KEY))
            assert rpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent" in (rpc.details() or "")
            assert dict(rpc.trailing_metadata() or ())["grpc-retry-pushback-ms"] == "1000"
            # Another key is not held back by this one's stream.
            assert (await complete(http, other, FREE_KEY)).status_code == 200
        # The client closed the stream: the tier cancels it and gives the key's place back.
        await asyncio.wait_for(engine.cancelled.wait(), TIMEOUT_S)

        async def served() -> bool:
            answer = await complete(http, other, CONCURRENT_KEY)
            assert answer.status_code in (200, 429), answer.text
            return answer.status_code == 200

        await until(served, "admitted once the stream ended")

        # The same over gRPC: a held call refuses the next, its cancellation frees the place.
        engine.hold_open = True
        call = generate_call(holder, CONCURRENT_KEY)
        assert (await call.read()).token_ids == [42]
        engine.hold_open = False
        assert (await complete(http, other, CONCURRENT_KEY)).status_code == 429
        call.cancel()

        async def served_by_grpc() -> bool:
            try:
                await generate(other, CONCURRENT_KEY)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            return True

        await until(served_by_grpc, "admitted once the call was cancelled")
    assert refused_count("max_concurrent") - refused_before >= 3


def test_max_concurrent_after_one_stream_ends_normally(model: ServedModel, key_file: str) -> None:
    """A request that finishes gives its place back before the client reads its end: the
    next one, sent at once, is admitted."""
    engine = FakeEngine(script_for([5, 6, 7], finish_reason="length"))

    async def scenario() -> None:
        async with (
            tier(model, engine, key_file) as stack,
            httpx.AsyncClient(timeout=TIMEOUT_S) as http,
        ):
            for stream in (False, True, False):
                answer = await complete(http, stack, CONCURRENT_KEY, stream=stream)
                assert answer.status_code == 200, answer.text
            for _ in range(3):
                await generate(stack, CONCURRENT_KEY)
            key_id = stack.server.access.authenticate_key(CONCURRENT_KEY).key_id
            assert stack.server.limiter.local.num_in_flight(key_id, NOW) == 0

    run(scenario)


def test_tpm_counts_prompt_and_output_tokens(model: ServedModel, key_file: str) -> None:
    output = [5, 6, 7, 8, 9]
    engine = FakeEngine(script_for(output, finish_reason="length"))

    async def scenario() -> None:
        await tpm_scenario(engine, key_file, model)

    run(scenario)


async def tpm_scenario(
    engine: FakeEngine, key_file: str, model: ServedModel, **config: Any
) -> None:
    """Five output tokens per answer; admitted while the key is under its tpm."""
    async with (
        tier(model, engine, key_file, **config) as stack,
        httpx.AsyncClient(timeout=TIMEOUT_S) as http,
    ):
        first = await complete(http, stack, TPM_KEY)
        assert first.status_code == 200, first.text
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        assert first.headers["x-ratelimit-limit-tokens"] == str(TPM)
        # At admission: the prompt counted, the output not yet generated.
        assert first.headers["x-ratelimit-remaining-tokens"] == str(TPM - prompt_tokens)
        assert first.headers["x-ratelimit-reset-tokens"] == "55s"
        used = prompt_tokens + 5
        while used < TPM:  # under the limit: admitted, whatever its prompt adds
            answer = await complete(http, stack, TPM_KEY, stream=used % 2 == 0)
            assert answer.status_code == 200, answer.text
            # The earlier answers' output tokens are counted by the time they end.
            remaining = TPM - used - prompt_tokens
            assert answer.headers["x-ratelimit-remaining-tokens"] == str(max(0, remaining))
            used += prompt_tokens + 5
        over = await complete(http, stack, TPM_KEY)
        assert over.status_code == 429, over.text
        assert "tpm" in over.json()["error"]["message"]
        assert over.headers["x-ratelimit-remaining-tokens"] == "0"
        assert over.headers["retry-after"] == "55"
        rpc = await rpc_error(generate(stack, TPM_KEY))
        assert rpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tpm" in (rpc.details() or "")


# ---- two tiers, one Redis ------------------------------------------------------------------


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def test_two_tiers_sharing_redis_see_one_count(
    model: ServedModel, key_file: str, redis: RedisServer
) -> None:
    engine_a = Engine(script_for([5, 6], finish_reason="stop"))
    engine_b = Engine(script_for([5, 6], finish_reason="stop"))

    async def scenario() -> None:
        async with (
            tier(model, engine_a, key_file, redis_url=redis.url) as a,
            tier(model, engine_b, key_file, redis_url=redis.url) as b,
        ):
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                # rpm=3: two requests at A, one at B, then both refuse.
                for stack in (a, a, b):
                    answer = await complete(http, stack, RPM_KEY)
                    assert answer.status_code == 200, answer.text
                assert answer.headers["x-ratelimit-remaining-requests"] == "0"
                for stack in (b, a):
                    answer = await complete(http, stack, RPM_KEY)
                    assert answer.status_code == 429, answer.text
                assert (await rpc_error(generate(b, RPM_KEY))).code() == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED
                )
                assert (await complete(http, b, FREE_KEY)).status_code == 200
            # max_concurrent=1: a stream held at A refuses the key at B.
            await max_concurrent_scenario(a, b, engine_a)
        # Every lease was given back (an empty sorted set is no key at all).
        assert redis.command("KEYS", "llmserve:v1:ratelimit:*:leases") == b"*0\r\n"

    run(scenario)


def test_tpm_shared_through_redis(model: ServedModel, key_file: str, redis: RedisServer) -> None:
    engine = FakeEngine(script_for([5, 6, 7, 8, 9], finish_reason="length"))

    async def scenario() -> None:
        await tpm_scenario(engine, key_file, model, redis_url=redis.url)

    run(scenario)


def test_redis_down_falls_back_to_counting_in_the_replica(
    model: ServedModel, key_file: str, redis: RedisServer
) -> None:
    engine = FakeEngine(script_for([5], finish_reason="stop"))

    async def scenario() -> None:
        async with tier(model, engine, key_file, redis_url=redis.url) as stack:
            redis.stop()
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                codes = [(await complete(http, stack, RPM_KEY)).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]

    run(scenario)
