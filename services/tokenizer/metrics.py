"""The tokenizer tier's metrics: what the client sees (TTFT, TPOT, ITL, end-to-end latency,
outcomes). Timings are taken when an scheduler message becomes the client's delta, on the same
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
from services.contracts.errors import RateLimitedError

REGISTRY = CollectorRegistry()
REDIS = RedisMetrics(REGISTRY)
ROUTED = Counter(
    "llmserve_routing_decisions_total",
    "Requests routed to a scheduler, by policy and why that one: cached_prefix (it holds the "
    "longest cached prefix), least_loaded, round_robin or only (a single scheduler).",
    ("policy", "reason"),
    registry=REGISTRY,
)
SCHEDULERS = Gauge(
    "llmserve_tokenizer_schedulers",
    "Schedulers this replica knows, by state: pending (listed by DNS, not answering yet), "
    "active (routed to) or draining (gone from DNS, its in-flight requests finishing).",
    ("state",),
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

RATE_LIMITED = Counter(
    "llmserve_rate_limited_total",
    "Requests refused for their API key's limit, by limit: max_concurrent, rpm or tpm (the "
    "key is never a label).",
    ("limit",),
    registry=REGISTRY,
)


def on_rejected(exc: BaseException) -> None:
    REJECTED.labels(rejection_reason(exc)).inc()
    if isinstance(exc, RateLimitedError):
        RATE_LIMITED.labels(exc.limit).inc()


class GenerateMetrics:
    """One Generate call, by either door: created on arrival, fed once per delta, and
    `done()` once when the call ends, however it ends (the gRPC door calls it from the RPC's
    done callback, the HTTP door when the response is over)."""

    __slots__ = (
        "_done",
        "_first_token_at",
        "_last_token_at",
        "_num_tokens",
        "_started",
        "finish_reason",
    )

    def __init__(self, started: float | None = None) -> None:
        self._started = time.perf_counter() if started is None else started
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._num_tokens = 0
        self._done = False
        self.finish_reason = ""
        """The public finish reason once the last message is built."""
        REQUESTS_IN_FLIGHT.inc()

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

    def done(self, code: str | None) -> None:
        """`code`: the call's status name (a gRPC code name; the HTTP door maps to them);
        None = no status (a normal end, or a client that went away)."""
        if self._done:
            return
        self._done = True
        REQUESTS_IN_FLIGHT.dec()
        E2E_REQUEST_LATENCY.observe(time.perf_counter() - self._started)
        if self._first_token_at is not None and self._num_tokens > 1:
            decode_s = self._last_token_at - self._first_token_at
            TIME_PER_OUTPUT_TOKEN.observe(decode_s / (self._num_tokens - 1))
        if code is None:
            code = "OK" if self.finish_reason else "CANCELLED"
        REQUESTS.labels(self.finish_reason or "none", code).inc()


def _observe_times(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value`: a message carries few tokens (usually one)."""
    for _ in range(count):
        histogram.observe(value)


def status_name(context: grpc.aio.ServicerContext) -> str | None:
    """A finished RPC's status code name; None when grpc.aio reports none (a normal end, or
    a stream the client cancelled)."""
    code = context.code()
    return None if code is None else str(code.name)
