"""Load sweeps for `bench serve`: parse lists of request rates and concurrencies, derive the
rates of a saturation-relative sweep, and reduce each point to one table row and one point of
the latency-throughput curve. Pure: no clock, no network."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.serve_metrics import ServeSummary

# `--sweep`: offered loads as fractions of the saturated request rate measured first. Below
# ~25% latency is flat; above ~90% queues grow without bound, so these four span the knee.
SATURATION_FRACTIONS = (0.25, 0.5, 0.75, 0.9)

# Each point draws its own prompts (seed + index * stride): repeating one prompt set would
# turn every later point into prefix-cache hits on a server that caches prefixes.
POINT_SEED_STRIDE = 1_000_003


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One offered load: Poisson arrivals at `request_rate` (inf = all at once), at most
    `concurrency` in flight (None = no cap)."""

    request_rate: float
    concurrency: int | None

    @property
    def label(self) -> str:
        parts = []
        if not math.isinf(self.request_rate):
            parts.append(f"{self.request_rate:g} req/s")
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        return ", ".join(parts) or "all at once"


@dataclass(frozen=True, slots=True)
class PointResult:
    point: SweepPoint
    num_prompts: int
    summary: ServeSummary


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One point of a latency-throughput plot; `series` groups points into one line."""

    series: str
    label: str
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; every rate must be > 0."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated request rates (or inf), got {text!r}") from None
    if not rates or not all(rate > 0 for rate in rates):  # `not >` also catches NaN
        raise ValueError(f"request rates must be > 0 (or inf), got {text!r}")
    return rates


def parse_concurrencies(text: str) -> list[int]:
    """'1,8,32,64' -> [1, 8, 32, 64]; every value must be a positive integer."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated concurrencies, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise ValueError(f"concurrencies must be >= 1, got {text!r}")
    return values


def sweep_points(rates: Sequence[float], concurrencies: Sequence[int | None]) -> list[SweepPoint]:
    """Every (rate, concurrency) pair, concurrency-major, each list in the order given."""
    if not rates or not concurrencies:
        raise ValueError("a sweep needs at least one rate and one concurrency")
    return [SweepPoint(rate, c) for c in concurrencies for rate in rates]


def saturation_rates(
    saturated_requests_per_s: float, fractions: Sequence[float] = SATURATION_FRACTIONS
) -> list[float]:
    """The Poisson rates of a `--sweep`: fractions of the throughput measured with every
    request offered at once, rounded to 3 significant digits so labels stay readable."""
    if not saturated_requests_per_s > 0 or math.isinf(saturated_requests_per_s):
        raise ValueError(
            f"the saturated run must complete requests at a finite rate > 0, "
            f"got {saturated_requests_per_s} req/s"
        )
    return [float(f"{fraction * saturated_requests_per_s:.3g}") for fraction in fractions]


def point_seed(seed: int, index: int) -> int:
    return seed + index * POINT_SEED_STRIDE


def load_order_key(point: SweepPoint) -> tuple[float, float]:
    """Concurrency-major (no cap last), then by rate with inf last: the order of a curve."""
    concurrency = math.inf if point.concurrency is None else point.concurrency
    return (concurrency, point.request_rate)


def in_load_order(results: Sequence[PointResult]) -> list[PointResult]:
    return sorted(results, key=lambda result: load_order_key(result.point))


SWEEP_HEADERS = [
    "load",
    "requests ok",
    "req/s",
    "output tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "ITL p50",
    "E2E p50",
    "E2E p99",
    "goodput req/s",
]


def sweep_rows(results: Sequence[PointResult]) -> list[list[object]]:
    rows: list[list[object]] = []
    for result in results:
        s = result.summary
        rows.append(
            [
                result.point.label,
                f"{s.num_completed}/{s.num_requests}",
                s.requests_per_s,
                s.output_tokens_per_s,
                s.ttft.p50_ms,
                s.ttft.p99_ms,
                s.tpot.p50_ms,
                s.tpot.p99_ms,
                s.itl.p50_ms,
                s.e2e.p50_ms,
                s.e2e.p99_ms,
                s.goodput_requests_per_s,
            ]
        )
    return rows


def curve_points(results: Sequence[PointResult]) -> list[CurvePoint]:
    """One curve when only the rate or only the concurrency varies; one curve per concurrency
    when both do (a rate sweep at each cap)."""
    concurrencies = {result.point.concurrency for result in results}
    rates = {result.point.request_rate for result in results}
    per_concurrency = len(concurrencies) > 1 and len(rates) > 1
    points = []
    for result in results:
        point, s = result.point, result.summary
        series = f"c={point.concurrency}" if per_concurrency else ""
        label = point.label
        if per_concurrency:
            label = "all at once" if math.isinf(point.request_rate) else f"{point.request_rate:g}"
        points.append(
            CurvePoint(
                series=series,
                label=label,
                output_tokens_per_s=s.output_tokens_per_s,
                ttft_p50_ms=s.ttft.p50_ms,
                ttft_p99_ms=s.ttft.p99_ms,
                tpot_p50_ms=s.tpot.p50_ms,
                tpot_p99_ms=s.tpot.p99_ms,
            )
        )
    return points
