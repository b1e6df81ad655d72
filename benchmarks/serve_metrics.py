"""Serving metrics from per-request event records: TTFT, TPOT, ITL and end-to-end latency
percentiles, throughput over the benchmark's wall time, goodput under an SLO, errors by status.
Pure: the load generator records times, this module only does arithmetic on them.

One request's timeline (times in seconds on one monotonic clock):

    send          chunk 0        chunk 1 (k=2)      chunk 2        end
     |--- TTFT ------|------ g1 -------|---- g2 -------|-------------|
     |<------------------------------ E2E ---------------------------->|

    TPOT = (E2E - TTFT) / (output_tokens - 1)           (none when output_tokens <= 1)
    ITL  = g1/2, g1/2, g2: a chunk carrying k tokens counts as k tokens, its gap spread
           evenly over them; extra tokens inside chunk 0 count as gaps of 0 (they came
           with the first token). So a request's ITLs sum to (last chunk - first chunk).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from benchmarks.common import mean, percentile

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed message that carried tokens."""

    time_s: float
    num_tokens: int


@dataclass(slots=True)
class RequestRecord:
    """What the load generator saw of one request."""

    send_time_s: float
    end_time_s: float = math.nan
    """When the stream ended (last message or error)."""
    chunks: list[Chunk] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    """The server's count when it reports one (usage), else the sum over chunks."""
    error: str | None = None
    """None on success; else a status such as 'RESOURCE_EXHAUSTED', 'HTTP 503', 'abort'."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the server served from its prefix cache (usage), when it reports them."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0].time_s - self.send_time_s if self.chunks else None

    @property
    def e2e_s(self) -> float:
        return self.end_time_s - self.send_time_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies, one per token after the first (see the module docstring)."""
        if not self.chunks:
            return []
        gaps = [0.0] * (self.chunks[0].num_tokens - 1)
        for previous, chunk in zip(self.chunks, self.chunks[1:], strict=False):
            if chunk.num_tokens > 0:
                gap = (chunk.time_s - previous.time_s) / chunk.num_tokens
                gaps.extend([gap] * chunk.num_tokens)
        return gaps


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of one latency metric, in milliseconds (NaN when there are no values)."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    count: int

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Distribution:
        values_ms = [1e3 * v for v in values_s]
        p50, p90, p99 = (percentile(values_ms, q) for q in PERCENTILES)
        return cls(p50, p90, p99, mean(values_ms), len(values_ms))


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objective per request; None = no bound on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        """A successful request meets the SLO when each bound set holds; a request with one
        output token has no TPOT and so meets any TPOT bound."""
        if not record.ok:
            return False
        ttft = record.ttft_s
        if self.ttft_ms is not None and (ttft is None or 1e3 * ttft > self.ttft_ms):
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or 1e3 * tpot <= self.tpot_ms


@dataclass(frozen=True, slots=True)
class ServeSummary:
    duration_s: float
    """Benchmark wall time: first send to last end, the divisor of every rate below."""
    num_requests: int
    num_completed: int
    errors: dict[str, int]
    """Failed requests by status, most frequent first."""
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    prompt_tokens: int
    """Over completed requests (failed ones count in no throughput)."""
    output_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens the server reported serving from its prefix cache (completed requests)."""
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    goodput_requests_per_s: float
    """Completed requests meeting the SLO per second; NaN when no SLO was given."""
    slo: Slo


def benchmark_duration(records: Iterable[RequestRecord]) -> float:
    """First send to last end over all requests, failed ones included."""
    records = list(records)
    if not records:
        return math.nan
    return max(r.end_time_s for r in records) - min(r.send_time_s for r in records)


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else math.nan


def summarize(
    records: Sequence[RequestRecord], slo: Slo | None = None, duration_s: float | None = None
) -> ServeSummary:
    """Latency distributions over successful requests; rates over `duration_s` (default: first
    send to last end). Failed requests appear only in `errors` and `num_requests`."""
    slo = slo or Slo()
    duration = benchmark_duration(records) if duration_s is None else duration_s
    completed = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    prompt_tokens = sum(r.prompt_tokens for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)
    return ServeSummary(
        duration_s=duration,
        num_requests=len(records),
        num_completed=len(completed),
        errors=dict(errors.most_common()),
        ttft=Distribution.of_seconds([t for r in completed if (t := r.ttft_s) is not None]),
        tpot=Distribution.of_seconds([t for r in completed if (t := r.tpot_s) is not None]),
        itl=Distribution.of_seconds([gap for r in completed for gap in r.itl_s]),
        e2e=Distribution.of_seconds([r.e2e_s for r in completed]),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in completed),
        requests_per_s=_rate(len(completed), duration),
        output_tokens_per_s=_rate(output_tokens, duration),
        total_tokens_per_s=_rate(prompt_tokens + output_tokens, duration),
        goodput_requests_per_s=(
            _rate(sum(slo.met_by(r) for r in completed), duration) if slo.is_set else math.nan
        ),
        slo=slo,
    )


LATENCY_HEADERS = ["metric (ms)", "p50", "p90", "p99", "mean", "count"]
THROUGHPUT_HEADERS = [
    "requests ok",
    "errors",
    "duration s",
    "req/s",
    "output tok/s",
    "total tok/s",
    "goodput req/s",
]


def latency_rows(summary: ServeSummary) -> list[list[object]]:
    return [
        [name, d.p50_ms, d.p90_ms, d.p99_ms, d.mean_ms, d.count]
        for name, d in (
            ("TTFT", summary.ttft),
            ("TPOT", summary.tpot),
            ("ITL", summary.itl),
            ("E2E", summary.e2e),
        )
    ]


def throughput_row(summary: ServeSummary) -> list[object]:
    return [
        summary.num_completed,
        summary.num_requests - summary.num_completed,
        summary.duration_s,
        summary.requests_per_s,
        summary.output_tokens_per_s,
        summary.total_tokens_per_s,
        summary.goodput_requests_per_s,
    ]
