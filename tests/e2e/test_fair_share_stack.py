"""Fair shares on a real stack: tenants bound to keys (one with weight 3), a tenant flooding
the scheduler, another arriving late. What is asserted is order and token counts, which hold
on a loaded machine; the times are printed (`llmserve bench serve --tenant-load` measures them
on a quiet one)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.client import auth_metadata
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow

FLOOD_KEY = "sk-flood-3a1f0c"
LATE_KEY = "sk-late-9b2e44"
HEAVY_KEY = "sk-heavy-5d7c19"
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    with tempfile.TemporaryDirectory(prefix="llmserve-fair-") as name:
        key_file = Path(name) / "keys.txt"
        key_file.write_text(
            f"{FLOOD_KEY} tenant=flood\n{LATE_KEY} tenant=late\n{HEAVY_KEY} tenant=heavy weight=3\n"
        )
        flags = ["--api-key-file", str(key_file), "--max-num-seqs", str(MAX_NUM_SEQS)]
        flags += ["--max-waiting-requests", "128", "--tokenizer-replicas", "1"]
        # One token per seat and step, so a tenant's share of seats is its share of tokens:
        # drafts accepted would give some seats several tokens in a step.
        flags += ["--no-speculation"]
        with e2e_stack(flags) as running:
            yield running


@dataclass
class Stream:
    tenant: str
    sent_at: float
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str = ""


async def generate(
    stub: text_pb2_grpc.TextGenerationStub, key: str, tenant: str, index: int, tokens: int
) -> Stream:
    stream = Stream(tenant, time.perf_counter())
    request = text_pb2.GenerateRequest(
        prompt=f"Request {index} of {tenant}: count slowly from one to a hundred.",
        sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True),
    )
    async for response in stub.Generate(request, metadata=auth_metadata(key), timeout=600):
        now = time.perf_counter()
        if response.token_ids and stream.first_token_at is None:
            stream.first_token_at = now
        stream.token_times += [now] * len(response.token_ids)
        stream.finish_reason = response.finish_reason or stream.finish_reason
    return stream


FLOOD_QUEUED = 16
"""Flood requests waiting when the late tenant arrives: twice the eight it must overtake."""


async def flood_queued(stack: RunningStack, timeout_s: float = 60.0) -> None:
    """Until the flood holds every seat and queues at least FLOOD_QUEUED more: a fixed sleep
    would be too short on a slow machine and too long on a fast one (the flood all served)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(stack.stats)
        if stats.num_running == MAX_NUM_SEQS and stats.num_waiting >= FLOOD_QUEUED:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the flood never held every seat with {FLOOD_QUEUED} queued: {stats}")


def test_a_late_tenant_is_served_before_the_flood_queued_ahead_of_it(
    stack: RunningStack,
) -> None:
    async def scenario() -> tuple[list[Stream], list[Stream]]:
        async with grpc.aio.insecure_channel(stack.public) as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            flood = [
                asyncio.create_task(generate(stub, FLOOD_KEY, "flood", i, 24)) for i in range(40)
            ]
            await flood_queued(stack)
            late = await asyncio.gather(*(generate(stub, LATE_KEY, "late", i, 8) for i in range(4)))
            return await asyncio.gather(*flood), late

    flood, late = asyncio.run(scenario())
    assert all(s.finish_reason == "length" for s in (*flood, *late))
    last_late_first = max(s.first_token_at or 0.0 for s in late)
    # Flood requests queued before the late tenant arrived and still without a token when
    # its last request had its first: without fair shares they would all go first.
    overtaken = [
        s
        for s in flood
        if s.sent_at < late[0].sent_at and (s.first_token_at or 0.0) > last_late_first
    ]
    late_ttft = [(s.first_token_at or 0.0) - s.sent_at for s in late]
    flood_ttft = [(s.first_token_at or 0.0) - s.sent_at for s in flood]
    print(
        f"\nlate tenant TTFT p50 {statistics.median(late_ttft):.2f} s "
        f"(max {max(late_ttft):.2f} s); flood TTFT p50 {statistics.median(flood_ttft):.2f} s; "
        f"{len(overtaken)} flood requests queued earlier started later"
    )
    assert len(overtaken) >= 8, (late_ttft, flood_ttft)


def test_saturating_tenants_split_tokens_by_weight(stack: RunningStack) -> None:
    async def scenario() -> list[Stream]:
        async with grpc.aio.insecure_channel(stack.public) as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            calls = []
            for i in range(24):
                calls.append(generate(stub, HEAVY_KEY, "heavy", i, 24))
                calls.append(generate(stub, FLOOD_KEY, "flood", i, 24))
            return await asyncio.gather(*calls)

    streams = asyncio.run(scenario())
    # While both saturate: until the first tenant's last token.
    end = min(
        max(t for s in streams if s.tenant == tenant for t in s.token_times)
        for tenant in ("heavy", "flood")
    )
    start = min(s.first_token_at or end for s in streams)
    window_start = start + (end - start) * 0.2  # past the first admissions
    counts = {
        tenant: sum(
            1
            for s in streams
            if s.tenant == tenant
            for t in s.token_times
            if window_start <= t <= end
        )
        for tenant in ("heavy", "flood")
    }
    ratio = counts["heavy"] / max(1, counts["flood"])
    print(f"\ntokens while both saturate: {counts} (heavy:flood = {ratio:.2f}, weights 3:1)")
    assert abs(ratio - 3.0) / 3.0 < 0.15, counts
