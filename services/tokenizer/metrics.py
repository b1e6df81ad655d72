"""The tokenizer tier's metrics: what the client sees (TTFT, TPOT, ITL, end-to-end latency,
outcomes). Timings are taken when an engine message becomes the client's delta, on the same
clock as the Timings of the last response.

Process-wide, like the logging configuration: one registry per process, scraped at /metrics.
"""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.grpc_server import rejection_reason
from services.common.metrics import LATENCY_BUCKETS_S
from services.common.redis_metrics import RedisMetrics

REGISTRY = CollectorRegistry()
REDIS = RedisMetrics(REGISTRY)
ROUTED = Counter(
    "llmserve_routing_decisions_total",
    "Requests routed to a scheduler, by policy and why that one: cached_prefix (it holds the "
    "longest cached prefix), least_loaded, round_robin or only (a single scheduler).",
    ("policy", "reason"),
    registry=REGISTRY,
)

REQUESTS_IN_FLIGHT = Gauge(
    "llmserve_tokenizer_requests_in_flight",
    "Generate calls in progress in this process.",
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "llmserve_time_to_first_token_seconds",
    "From the Generate call's arrival to its first generated token.",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "llmserve_time_per_output_token_seconds",
    "Per request: (last token time - first token time) / (generated tokens - 1).",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "llmserve_inter_token_latency_seconds",
    "Gap between consecutive generated tokens of one request (a message of k tokens counts "
    "k times, gap/k each).",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
E2E_REQUEST_LATENCY = Histogram(
    "llmserve_e2e_request_latency_seconds",
    "From the Generate call's arrival to its end (any outcome).",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
REQUESTS = Counter(
    "llmserve_requests_total",
    "Finished Generate calls by finish reason (none: ended without one) and gRPC status.",
    ("finish_reason", "code"),
    registry=REGISTRY,
)
REJECTED = Counter(
    "llmserve_requests_rejected_total",
    "Requests refused before generating, by reason.",
    ("reason",),
    registry=REGISTRY,
)


def on_rejected(exc: BaseException) -> None:
    REJECTED.labels(rejection_reason(exc)).inc()


class GenerateMetrics:
    """One Generate call: created on arrival, fed once per engine message, observed once when
    the RPC ends (a done callback, so every outcome, client cancel included, is counted)."""

    __slots__ = ("_first_token_at", "_last_token_at", "_num_tokens", "_started", "finish_reason")

    def __init__(self, context: grpc.aio.ServicerContext, started: float | None = None) -> None:
        self._started = time.perf_counter() if started is None else started
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._num_tokens = 0
        self.finish_reason = ""
        """The public finish reason once the last message is built."""
        REQUESTS_IN_FLIGHT.inc()
        context.add_done_callback(lambda _: self._done(context))

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
            TIME_TO_FIRST_TOKEN.observe(now - self._started)
            _observe_times(INTER_TOKEN_LATENCY, 0.0, num_tokens - 1)
        else:
            gap_s = (now - self._last_token_at) / num_tokens
            _observe_times(INTER_TOKEN_LATENCY, gap_s, num_tokens)
        self._last_token_at = now
        self._num_tokens += num_tokens

    def _done(self, context: grpc.aio.ServicerContext) -> None:
        REQUESTS_IN_FLIGHT.dec()
        E2E_REQUEST_LATENCY.observe(time.perf_counter() - self._started)
        if self._first_token_at is not None and self._num_tokens > 1:
            decode_s = self._last_token_at - self._first_token_at
            TIME_PER_OUTPUT_TOKEN.observe(decode_s / (self._num_tokens - 1))
        REQUESTS.labels(self.finish_reason or "none", _status_name(context, self)).inc()


def _observe_times(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value`: a message carries few tokens (usually one)."""
    for _ in range(count):
        histogram.observe(value)


def _status_name(context: grpc.aio.ServicerContext, metrics: GenerateMetrics) -> str:
    code = context.code()
    if code is not None:
        return str(code.name)
    # grpc.aio reports no code for a stream the client cancelled, nor for a normal end.
    return "OK" if metrics.finish_reason else "CANCELLED"
