"""Bursts of streams on a real stack with small limits (4 seats, 8 waiting): a burst up to
seats + queue is accepted whole, however fast it arrives; beyond it exactly the excess is
refused, each refusal with the scheduler's retry hint (gRPC: `grpc-retry-pushback-ms` trailing
metadata; HTTP: 429 with Retry-After); every KV block is free afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.common.grpc_server import REASON_METADATA_KEY, RETRY_PUSHBACK_METADATA_KEY
from services.scheduler.features.retry_hint import MAX_RETRY_AFTER_MS
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

NUM_SEATS = 4  # --max-num-seqs
NUM_WAITING = 8  # --max-waiting-requests
CAPACITY = NUM_SEATS + NUM_WAITING
OVERLOAD_BURST = 20
# Long enough that no stream of a held burst finishes (and makes room) before it is counted.
HELD_MAX_NEW_TOKENS = 512
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def small() -> Iterator[RunningStack]:
    limits = ["--max-num-seqs", str(NUM_SEATS), "--max-waiting-requests", str(NUM_WAITING)]
    with e2e_stack(limits) as running:
        yield running
    assert running.returncode == 0


def request(index: int, max_new_tokens: int) -> text_pb2.GenerateRequest:
    return text_pb2.GenerateRequest(
        prompt=f"Item {index}: count from one to ten.",
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
        ),
    )


@dataclass
class Refusal:
    code: str
    reason: str | None
    retry_after: str | None
    """gRPC: the pushback in ms; HTTP: Retry-After in seconds."""


@dataclass
class Burst:
    finished: list[int] = field(default_factory=list)
    """Completion tokens of each stream that ended normally."""
    refused: list[Refusal] = field(default_factory=list)


async def held_in_scheduler(stack: RunningStack) -> int:
    stats = await asyncio.to_thread(stack.stats)
    return int(stats.num_running + stats.num_waiting)


async def hold_until_counted(stack: RunningStack, burst: Burst, tasks: list[asyncio.Task]) -> int:
    """Wait until every stream of the burst is either refused or held by the scheduler (so
    no refusal can still come), then end the held ones; returns how many were held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while (held := await held_in_scheduler(stack)) + len(burst.refused) < len(tasks):
        assert loop.time() < deadline, (held, burst.refused)
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return held


async def grpc_burst(stack: RunningStack, size: int, max_new_tokens: int, hold: bool) -> Burst:
    """`size` Generate streams at once on the public gRPC door. Held: counted, then cancelled
    (see hold_until_counted); else run to their end."""
    burst = Burst()
    async with grpc.aio.insecure_channel(stack.public) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)

        async def one(index: int) -> None:
            call = stub.Generate(request(index, max_new_tokens), timeout=TIMEOUT_S)
            try:
                responses = [r async for r in call]
            except grpc.aio.AioRpcError as exc:
                metadata = dict(exc.trailing_metadata() or ())
                burst.refused.append(
                    Refusal(
                        exc.code().name,
                        metadata.get(REASON_METADATA_KEY),
                        metadata.get(RETRY_PUSHBACK_METADATA_KEY),
                    )
                )
                return
            burst.finished.append(sum(len(r.token_ids) for r in responses))

        tasks = [asyncio.create_task(one(i)) for i in range(size)]
        if hold:
            await hold_until_counted(stack, burst, tasks)
        else:
            await asyncio.gather(*tasks)
    return burst


async def http_burst(stack: RunningStack, size: int, model: str) -> Burst:
    """`size` streaming completions at once on the OpenAI door, counted, then closed."""
    burst = Burst()
    body = {
        "model": model,
        "max_tokens": HELD_MAX_NEW_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:

        async def one(index: int) -> None:
            payload = {**body, "prompt": f"Item {index}: count from one to ten."}
            async with http.stream("POST", f"{stack.http}/completions", json=payload) as response:
                if response.status_code != 200:
                    error = (await response.aread()).decode()
                    burst.refused.append(
                        Refusal(
                            str(response.status_code),
                            "queue_full" if '"queue_full"' in error else error,
                            response.headers.get("retry-after"),
                        )
                    )
                    return
                async for _ in response.aiter_bytes():
                    pass  # held until cancelled

        tasks = [asyncio.create_task(one(i)) for i in range(size)]
        await hold_until_counted(stack, burst, tasks)
    return burst


def assert_all_blocks_free(stack: RunningStack) -> None:
    stats = stack.wait_all_blocks_free(timeout_s=30)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_burst_of_seats_plus_queue_is_accepted_whole(small: RunningStack) -> None:
    burst = asyncio.run(grpc_burst(small, CAPACITY, max_new_tokens=8, hold=False))
    assert burst.refused == []
    assert burst.finished == [8] * CAPACITY
    assert_all_blocks_free(small)


def test_grpc_refuses_exactly_the_overload_with_a_retry_pushback(small: RunningStack) -> None:
    burst = asyncio.run(grpc_burst(small, OVERLOAD_BURST, HELD_MAX_NEW_TOKENS, hold=True))
    assert len(burst.refused) == OVERLOAD_BURST - CAPACITY, burst.refused
    for refusal in burst.refused:
        assert (refusal.code, refusal.reason) == ("RESOURCE_EXHAUSTED", "queue_full")
        assert refusal.retry_after is not None
        assert 1 <= int(refusal.retry_after) <= MAX_RETRY_AFTER_MS
    assert_all_blocks_free(small)


def test_http_refuses_exactly_the_overload_with_retry_after(small: RunningStack) -> None:
    model = httpx.get(f"{small.http}/models", timeout=10).json()["data"][0]["id"]
    burst = asyncio.run(http_burst(small, OVERLOAD_BURST, model))
    assert len(burst.refused) == OVERLOAD_BURST - CAPACITY, burst.refused
    for refusal in burst.refused:
        assert (refusal.code, refusal.reason) == ("429", "queue_full")
        assert refusal.retry_after is not None
        assert 1 <= int(refusal.retry_after) <= MAX_RETRY_AFTER_MS // 1000
    assert_all_blocks_free(small)
