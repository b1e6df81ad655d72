"""Metrics of a process's Redis use (the same names in every service that talks to Redis)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RedisMetrics:
    """Registers the Redis families on a service's registry; the store reports to it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._errors = Counter(
            "llmserve_redis_errors_total",
            "Redis calls that failed or timed out (each is served as a cache miss).",
            ("operation",),
            registry=registry,
        )
        self._up = Gauge(
            "llmserve_redis_up",
            "1 while Redis answers, 0 after a failed call until one succeeds.",
            registry=registry,
        )
        self._up.set(1)

    def failed(self, operation: str) -> None:
        self._errors.labels(operation).inc()
        self._up.set(0)

    def answered(self) -> None:
        self._up.set(1)
