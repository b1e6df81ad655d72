"""What every service's metrics share, on top of prometheus_client: the bucket bounds and the
exposition settings. Each service defines its families in its own `metrics.py`, on its own
CollectorRegistry (so no process or GC collectors join the page)."""

from __future__ import annotations

from prometheus_client import disable_created_metrics

# The pages carry what docs/metrics.md lists; the client's `_created` series (one start
# timestamp per counter and histogram series) would double the page for no query we make.
disable_created_metrics()

# Seconds, from a fast decode step on a GPU to a long request on a CPU.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# Counts of things per step (sequences, tokens): powers of two.
SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(14))


class BoundedLabels:
    """Label values for names a caller chooses (tenants, LoRA adapters): every value is a time
    series, so the first `limit` names seen keep their own and later ones share "other"."""

    def __init__(self, limit: int, empty: str = "none") -> None:
        self.limit = limit
        self.empty = empty
        self.labels: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        label = self.labels.get(name)
        if label is None:
            label = (name or self.empty) if len(self.labels) < self.limit else "other"
            if label != "other":
                self.labels[name] = label
        return label
