"""Serving metrics on hand-built event streams, with the answers computed by hand."""

from __future__ import annotations

import math

import pytest

from benchmarks.serve_metrics import (
    Chunk,
    Distribution,
    RequestRecord,
    Slo,
    latency_rows,
    summarize,
    throughput_row,
)

PROMPT_TOKENS = 10


def record(
    send: float,
    chunks: list[tuple[float, int]],
    end: float,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        send_time_s=send,
        end_time_s=end,
        chunks=[Chunk(t, k) for t, k in chunks],
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=sum(k for _, k in chunks),
        error=error,
    )


# A: one token per chunk, then a chunk of two.   TTFT 100 ms, TPOT 400/3 ms, ITL 200 100 100
# B: a single token.                              TTFT 200 ms, no TPOT, no ITL
# C: three tokens in the first chunk, then one.   TTFT 400 ms, TPOT 200 ms, ITL 0 0 600
A = record(0.0, [(0.1, 1), (0.3, 1), (0.5, 2)], end=0.5)
B = record(1.0, [(1.2, 1)], end=1.25)
C = record(0.5, [(0.9, 3), (1.5, 1)], end=1.5)
# Failures: excluded from every latency and throughput, counted by status; the last one
# streamed a token before failing and ends the benchmark at 2.0 s.
D = record(0.2, [], end=0.3, error="RESOURCE_EXHAUSTED")
E = record(0.25, [], end=0.35, error="RESOURCE_EXHAUSTED")
F = record(0.1, [(0.15, 1)], end=2.0, error="UNAVAILABLE")
RECORDS = [A, B, C, D, E, F]


def test_per_request_metrics() -> None:
    assert A.ttft_s == pytest.approx(0.1)
    assert A.tpot_s == pytest.approx(0.4 / 3)
    assert A.itl_s == pytest.approx([0.2, 0.1, 0.1])
    assert A.e2e_s == pytest.approx(0.5)
    assert C.itl_s == pytest.approx([0.0, 0.0, 0.6])
    assert C.tpot_s == pytest.approx(0.2)


def test_one_token_has_no_tpot_and_no_itl() -> None:
    assert B.tpot_s is None
    assert B.itl_s == []
    assert B.ttft_s == pytest.approx(0.2)


def test_itl_spreads_a_chunk_over_its_tokens_and_sums_to_the_decode_span() -> None:
    request = record(0.0, [(1.0, 1), (1.4, 4), (2.0, 3)], end=2.0)
    assert request.itl_s == pytest.approx([0.1] * 4 + [0.2] * 3)
    assert sum(request.itl_s) == pytest.approx(2.0 - 1.0)
    assert len(request.itl_s) == request.output_tokens - 1


def test_no_chunks_means_no_ttft() -> None:
    assert D.ttft_s is None
    assert D.tpot_s is None
    assert D.itl_s == []


def check(distribution: Distribution, p50: float, p90: float, p99: float, mean: float) -> None:
    assert distribution.p50_ms == pytest.approx(p50)
    assert distribution.p90_ms == pytest.approx(p90)
    assert distribution.p99_ms == pytest.approx(p99)
    assert distribution.mean_ms == pytest.approx(mean)


def test_distributions_over_successful_requests() -> None:
    summary = summarize(RECORDS)
    # TTFT 100 200 400: p90 at rank 1.8 = 200 + 0.8 * 200, p99 at rank 1.98.
    check(summary.ttft, 200, 360, 396, 700 / 3)
    assert summary.ttft.count == 3
    # TPOT 133.3 200 (B has none): p50 at rank 0.5.
    check(summary.tpot, 500 / 3, 400 / 3 + 0.9 * 200 / 3, 400 / 3 + 0.99 * 200 / 3, 500 / 3)
    assert summary.tpot.count == 2
    # ITL pooled over requests, sorted: 0 0 100 100 200 600; p90 at rank 4.5, p99 at 4.95.
    check(summary.itl, 100, 400, 580, 1000 / 6)
    assert summary.itl.count == 6
    # E2E 250 500 1000.
    check(summary.e2e, 500, 900, 990, 1750 / 3)


def test_rates_over_the_benchmark_wall_time() -> None:
    summary = summarize(RECORDS)
    assert summary.duration_s == pytest.approx(2.0)  # first send 0.0 (A), last end 2.0 (F)
    assert summary.num_requests == 6
    assert summary.num_completed == 3
    assert summary.output_tokens == 9
    assert summary.prompt_tokens == 30
    assert summary.requests_per_s == pytest.approx(1.5)
    assert summary.output_tokens_per_s == pytest.approx(4.5)
    assert summary.total_tokens_per_s == pytest.approx(19.5)
    assert math.isnan(summary.goodput_requests_per_s)  # no SLO given


def test_explicit_duration_overrides_first_send_to_last_end() -> None:
    assert summarize(RECORDS, duration_s=3.0).requests_per_s == pytest.approx(1.0)


def test_errors_counted_by_status_most_frequent_first() -> None:
    summary = summarize(RECORDS)
    assert summary.errors == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert list(summary.errors) == ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]
    assert throughput_row(summary)[:2] == [3, 3]


@pytest.mark.parametrize(
    ("slo", "goodput"),
    [
        (Slo(ttft_ms=300, tpot_ms=150), 1.0),  # A and B; C misses both
        (Slo(tpot_ms=150), 1.0),  # A, and B (no TPOT meets any TPOT bound)
        (Slo(ttft_ms=450), 1.5),  # all three successes
        (Slo(ttft_ms=50), 0.0),
    ],
)
def test_goodput(slo: Slo, goodput: float) -> None:
    assert summarize(RECORDS, slo).goodput_requests_per_s == pytest.approx(goodput)


def test_failed_request_never_meets_the_slo() -> None:
    assert not Slo(ttft_ms=1e9).met_by(F)


def test_no_requests_gives_nan_not_an_exception() -> None:
    summary = summarize([])
    assert math.isnan(summary.duration_s)
    assert math.isnan(summary.ttft.p50_ms)
    assert math.isnan(summary.requests_per_s)
    assert summary.errors == {}


def test_only_failures_give_empty_distributions() -> None:
    summary = summarize([D, E])
    assert summary.num_completed == 0
    assert summary.ttft.count == 0
    assert summary.requests_per_s == 0.0
    assert [row[0] for row in latency_rows(summary)] == ["TTFT", "TPOT", "ITL", "E2E"]
