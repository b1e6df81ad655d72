"""One /metrics page for a whole stack: scrape each process's page, label every sample with
the process it came from, and merge families so each appears once (Prometheus rejects a page
that declares a family twice).

Pages are read with prometheus_client's parser; `merge_families` is pure, `Aggregator` is the
collector that scrapes on every request to the stack's page.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from services.common.metrics_http import MetricsServer, start_metrics_server

# Labels the aggregator adds; a process's own label of the same name is kept as exported_<name>.
TARGET_LABELS = ("service", "instance")
SCRAPE_UP = "llmserve_scrape_up"


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    service: str
    """tokenizer, scheduler or worker."""
    instance: str
    """The process's name in the stack (tokenizer-0, scheduler, ...)."""
    url: str


def _declared_name(family: Metric) -> str:
    """The name a page declares in # TYPE: the parser drops a counter's `_total`."""
    return f"{family.name}_total" if family.type == "counter" else family.name


def add_labels(family: Metric, extra: dict[str, str]) -> Metric:
    """The family with `extra` labels on every sample; a sample's own label under one of
    those names is renamed exported_<name> (as Prometheus does with honor_labels off)."""
    labelled = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        own = {
            (f"exported_{label}" if label in extra else label): value
            for label, value in sample.labels.items()
        }
        labelled.samples.append(sample._replace(labels={**extra, **own}))
    return labelled


def merge_families(pages: Sequence[tuple[dict[str, str], Iterable[Metric]]]) -> list[Metric]:
    """(labels to add, parsed page) per process → the families of one page, each once.

    The first page to declare a family gives its help and type; samples from a page that
    declares the same name with another type are dropped (they could not be queried as one).
    """
    merged: dict[str, Metric] = {}
    for extra, families in pages:
        for family in families:
            labelled = add_labels(family, extra)
            target = merged.setdefault(_declared_name(family), labelled)
            if target is not labelled and target.type == family.type:
                target.samples.extend(labelled.samples)
    return list(merged.values())


class Aggregator(Collector):
    """Scrapes every target on each collection; a process that does not answer is left out of
    the page and shows as llmserve_scrape_up 0."""

    def __init__(self, targets: Sequence[ScrapeTarget], timeout_s: float = 2.0) -> None:
        self.targets = list(targets)
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            SCRAPE_UP,
            "1 when the launcher could read the process's /metrics, else 0.",
            labels=TARGET_LABELS,
        )
        pages: list[tuple[dict[str, str], list[Metric]]] = []
        for target in self.targets:
            families = self._scrape(target.url)
            if families is not None:
                labels = {"service": target.service, "instance": target.instance}
                pages.append((labels, families))
            up.add_metric([target.service, target.instance], 0.0 if families is None else 1.0)
        yield up
        yield from merge_families(pages)

    def _scrape(self, url: str) -> list[Metric] | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8")
            return list(text_string_to_metric_families(text))
        except (OSError, ValueError):  # refused (restarting), timed out, HTTP error, torn page
            return None


def start_aggregate_server(
    host: str, port: int | None, targets: Sequence[ScrapeTarget]
) -> MetricsServer | None:
    """The stack's /metrics on host:port (0 = any free port), or None when `port` is None."""
    registry = CollectorRegistry()
    registry.register(Aggregator(targets))
    return start_metrics_server(registry, host, port, "stack")
