"""Load driving for `llmserve bench serve`: how requests are offered to a target (Poisson
arrivals under a concurrency cap), one benchmark point run end to end, and its latency tables.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm import tqdm  # type: ignore[import-untyped]

from benchmarks.common import format_table
from benchmarks.serve_metrics import (
    LATENCY_HEADERS,
    THROUGHPUT_HEADERS,
    RequestRecord,
    ServeSummary,
    Slo,
    latency_rows,
    summarize,
    throughput_row,
)
from benchmarks.serve_workload import Sample, arrival_offsets
from services.common.grpc_server import install_uvloop


@dataclass(frozen=True, slots=True)
class Load:
    """How requests are offered: Poisson arrivals at `request_rate` (inf = all at once), at
    most `concurrency` in flight (None = no cap)."""

    request_rate: float = math.inf
    concurrency: int | None = None
    seed: int = 0

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate} req/s"
        cap = f"concurrency {self.concurrency}" if self.concurrency else "no concurrency cap"
        return f"arrivals: {rate} (Poisson, seed {self.seed}); {cap}"


@dataclass(frozen=True, slots=True)
class Generation:
    """Per-request generation settings, the same for every target."""

    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = None
    num_speculative_tokens: int | None = None
    """Our servers' per-request speculation limit; None: not sent (the server's default)."""


class Target(Protocol):
    """Where requests go. `run` sends every sample at its offset and returns one record per
    sample, in sample order."""

    description: str

    def run(
        self,
        samples: Sequence[Sample],
        offsets: Sequence[float],
        concurrency: int | None,
        progress: tqdm | None,
    ) -> list[RequestRecord]: ...

    def close(self) -> None: ...


# ---- asyncio clients: driven by one event loop ------------------------------------------------


class ClientStartError(RuntimeError):
    """A client could not get ready to send (no connection, TLS refused, no model name): every
    request of the run fails with `status`."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class StreamingClient(Protocol):
    async def start(self) -> None:
        """Connect (or check the server) before timing; ClientStartError when it cannot."""

    async def generate(self, sample: Sample, slot: int) -> RequestRecord: ...

    async def close(self) -> None: ...


async def drive(
    client: StreamingClient,
    samples: Sequence[Sample],
    offsets: Sequence[float],
    concurrency: int | None,
    progress: tqdm | None,
) -> list[RequestRecord]:
    """Send sample i at `offsets[i]` seconds after the start, once one of `concurrency` slots
    is free. The slot number picks the client's channel, so each slot keeps its connection."""
    slots: asyncio.Queue[int] = asyncio.Queue()
    for slot in range(concurrency or len(samples)):
        slots.put_nowait(slot)
    start = time.perf_counter()

    async def one(index: int, sample: Sample) -> RequestRecord:
        delay = start + offsets[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        slot = await slots.get()
        try:
            return await client.generate(sample, slot)
        finally:
            slots.put_nowait(slot)
            if progress is not None:
                progress.update()

    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(samples))))


class AsyncTarget:
    """A target reached through an asyncio client; each run gets a fresh event loop."""

    def __init__(self, description: str, make_client: Any) -> None:
        self.description = description
        self.make_client = make_client

    def run(
        self,
        samples: Sequence[Sample],
        offsets: Sequence[float],
        concurrency: int | None,
        progress: tqdm | None,
    ) -> list[RequestRecord]:
        install_uvloop()

        async def main() -> list[RequestRecord]:
            client: StreamingClient = self.make_client()
            try:
                await client.start()
            except ClientStartError as exc:
                await client.close()
                print(f"bench serve: {self.description}: {exc}", file=sys.stderr, flush=True)
                return failed_records(len(samples), exc.status, progress)
            try:
                return await drive(client, samples, offsets, concurrency, progress)
            finally:
                await client.close()

        return asyncio.run(main())

    def close(self) -> None:
        pass


def failed_records(count: int, status: str, progress: tqdm | None) -> list[RequestRecord]:
    now = time.perf_counter()
    if progress is not None:
        progress.update(count)
    return [RequestRecord(now, now, error=status) for _ in range(count)]


# ---- one benchmark point --------------------------------------------------------------------


def warm_up(target: Target, samples: Sequence[Sample], concurrency: int | None) -> None:
    """Untimed requests, all at once under the concurrency cap."""
    if samples:
        target.run(samples, [0.0] * len(samples), concurrency, None)


def run_point(
    target: Target,
    samples: Sequence[Sample],
    load: Load,
    slo: Slo,
    warmup_samples: Sequence[Sample] = (),
    show_progress: bool = True,
    description: str = "requests",
) -> tuple[ServeSummary, list[RequestRecord]]:
    """Warm up, then offer `samples` under `load`. The unit a request-rate sweep repeats, one
    call per rate."""
    warm_up(target, warmup_samples, load.concurrency)
    offsets = arrival_offsets(len(samples), load.request_rate, load.seed)
    progress = tqdm(
        total=len(samples), desc=description, file=sys.stderr, disable=not show_progress
    )
    try:
        records = target.run(samples, offsets, load.concurrency, progress)
    finally:
        progress.close()
    return summarize(records, slo), records


def report(summary: ServeSummary) -> str:
    lines = [
        format_table(LATENCY_HEADERS, latency_rows(summary)),
        "",
        format_table(THROUGHPUT_HEADERS, [throughput_row(summary)]),
    ]
    if summary.slo.is_set:
        lines.append(
            f"\ngoodput SLO: TTFT <= {summary.slo.ttft_ms} ms, TPOT <= {summary.slo.tpot_ms} ms"
        )
    if summary.errors:
        listed = ", ".join(f"{status}: {count}" for status, count in summary.errors.items())
        lines.append(f"\nerrors by status: {listed}")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------
