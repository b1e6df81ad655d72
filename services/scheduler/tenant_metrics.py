"""Metrics per tenant: seats held, requests waiting, queue time and refusals, so an operator
sees who the fair shares (fair_share.py) hold back. Tenants are labels: the first
MAX_TENANT_LABELS seen keep their own, later ones share "other" (a request may name any
tenant, and every label is a time series). Requests that name none show as "none"."""

from __future__ import annotations

from collections import Counter

from prometheus_client import Counter as CounterMetric
from prometheus_client import Gauge, Histogram

from services.common.grpc_server import rejection_reason
from services.common.metrics import LATENCY_BUCKETS_S, BoundedLabels
from services.scheduler.metrics import REGISTRY
from services.scheduler.scheduler import Scheduler

MAX_TENANT_LABELS = 64

TENANT_RUNNING = Gauge(
    "llmserve_scheduler_tenant_running_requests",
    "Requests holding a seat (KV blocks), by tenant.",
    ("tenant",),
    registry=REGISTRY,
)
TENANT_WAITING = Gauge(
    "llmserve_scheduler_tenant_waiting_requests",
    "Requests waiting for a seat (never admitted, or preempted), by tenant.",
    ("tenant",),
    registry=REGISTRY,
)
TENANT_QUEUE_TIME = Histogram(
    "llmserve_scheduler_tenant_queue_time_seconds",
    "From a request's arrival at the scheduler to its first step, by tenant.",
    ("tenant",),
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
TENANT_REJECTED = CounterMetric(
    "llmserve_scheduler_tenant_requests_rejected_total",
    "Requests the scheduler refused, by tenant and reason (queue_full: over the bound and "
    "over the tenant's share of it).",
    ("tenant", "reason"),
    registry=REGISTRY,
)

tenant_label = BoundedLabels(MAX_TENANT_LABELS)


def on_step(scheduler: Scheduler) -> None:
    """Seats and queue per tenant; tenants that held something before and nothing now go to
    0 (their series stay, as labels are bounded)."""
    tenant_of = scheduler.fair.tenant_of
    running = Counter(tenant_label(tenant_of(r)) for r in scheduler.running)
    waiting = Counter(tenant_label(tenant_of(r)) for r in scheduler.waiting)
    for label in {*tenant_label.labels.values(), *running, *waiting}:
        TENANT_RUNNING.labels(label).set(running[label])
        TENANT_WAITING.labels(label).set(waiting[label])


def on_first_scheduled(tenant_id: str, queue_s: float | None) -> None:
    if queue_s is not None:
        TENANT_QUEUE_TIME.labels(tenant_label(tenant_id)).observe(queue_s)


def on_rejected(tenant_id: str, error: BaseException) -> None:
    TENANT_REJECTED.labels(tenant_label(tenant_id), rejection_reason(error)).inc()
