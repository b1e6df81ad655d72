"""The exposition text our pages carry, byte for byte, and the stack's page merging."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics_aggregate import (
    Aggregator,
    ScrapeTarget,
    add_labels,
    merge_families,
)
from services.common.metrics_http import MetricsServer
from services.contracts.step import BatchPlan
from services.scheduler.metrics import step_kind
from services.tokenizer import metrics as tokenizer_metrics


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_counter_with_labels_renders_help_type_and_samples() -> None:
    registry = CollectorRegistry()
    requests = Counter("llmserve_x_total", "Requests.", ("code", "reason"), registry=registry)
    requests.labels("OK", "stop").inc()
    requests.labels("OK", "stop").inc(2)
    requests.labels("CANCELLED", "none").inc()
    assert render(registry) == (
        "# HELP llmserve_x_total Requests.\n"
        "# TYPE llmserve_x_total counter\n"
        'llmserve_x_total{code="OK",reason="stop"} 3.0\n'
        'llmserve_x_total{code="CANCELLED",reason="none"} 1.0\n'
    )


def test_unlabelled_gauge_starts_at_zero_and_moves_both_ways() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("llmserve_in_flight", "In flight.", registry=registry)
    assert render(registry).endswith("llmserve_in_flight 0.0\n")
    gauge.inc()
    gauge.inc(2)
    gauge.dec()
    assert render(registry).endswith("llmserve_in_flight 2.0\n")
    gauge.set(0.25)
    assert render(registry) == (
        "# HELP llmserve_in_flight In flight.\n"
        "# TYPE llmserve_in_flight gauge\n"
        "llmserve_in_flight 0.25\n"
    )


def test_histogram_buckets_are_cumulative_with_inclusive_bounds() -> None:
    registry = CollectorRegistry()
    latency = Histogram(
        "llmserve_t_seconds", "Latency.", ("kind",), buckets=(0.1, 1.0), registry=registry
    )
    series = latency.labels("decode")
    for value in (0.05, 0.1, 0.5, 2.0):  # 0.1 sits exactly on a bound: le is inclusive
        series.observe(value)
    series.observe(0.5)
    series.observe(0.5)
    assert render(registry) == (
        "# HELP llmserve_t_seconds Latency.\n"
        "# TYPE llmserve_t_seconds histogram\n"
        'llmserve_t_seconds_bucket{kind="decode",le="0.1"} 2.0\n'
        'llmserve_t_seconds_bucket{kind="decode",le="1.0"} 5.0\n'
        'llmserve_t_seconds_bucket{kind="decode",le="+Inf"} 6.0\n'
        'llmserve_t_seconds_count{kind="decode"} 6.0\n'
        'llmserve_t_seconds_sum{kind="decode"} 3.65\n'
    )


def test_unobserved_labelled_metric_renders_only_its_header() -> None:
    registry = CollectorRegistry()
    Histogram("llmserve_h_seconds", "H.", ("kind",), registry=registry)
    assert render(registry) == (
        "# HELP llmserve_h_seconds H.\n# TYPE llmserve_h_seconds histogram\n"
    )


def test_label_values_and_help_are_escaped() -> None:
    registry = CollectorRegistry()
    counter = Counter(
        "llmserve_e_total", 'Back\\slash and\nnewline "quoted".', ("v",), registry=registry
    )
    counter.labels('a"b\\c\nd').inc()
    assert render(registry) == (
        '# HELP llmserve_e_total Back\\\\slash and\\nnewline "quoted".\n'
        "# TYPE llmserve_e_total counter\n"
        'llmserve_e_total{v="a\\"b\\\\c\\nd"} 1.0\n'
    )


def test_step_kind() -> None:
    assert step_kind(BatchPlan(0, num_scheduled_tokens={"a": 1, "b": 1})) == "decode"
    assert step_kind(BatchPlan(0, num_scheduled_tokens={"a": 7})) == "prefill"
    assert step_kind(BatchPlan(0, num_scheduled_tokens={"a": 7, "b": 1})) == "mixed"


# ---- merging pages ------------------------------------------------------------------------

WORKER_PAGE = """\
# HELP llmserve_forward_seconds Forward.
# TYPE llmserve_forward_seconds histogram
llmserve_forward_seconds_bucket{le="0.1"} 1.0
llmserve_forward_seconds_bucket{le="+Inf"} 2.0
llmserve_forward_seconds_sum 0.5
llmserve_forward_seconds_count 2.0
"""
TOKENIZER_PAGE = """\
# HELP llmserve_requests_total Requests.
# TYPE llmserve_requests_total counter
llmserve_requests_total{code="OK",finish_reason="stop"} 1.0
# HELP llmserve_requests_rejected_total Rejected.
# TYPE llmserve_requests_rejected_total counter
llmserve_requests_rejected_total{reason="invalid_argument"} 2.0
"""
SCHEDULER_PAGE = """\
# HELP llmserve_requests_rejected_total Rejected by the scheduler.
# TYPE llmserve_requests_rejected_total counter
llmserve_requests_rejected_total{reason="queue_full"} 1.0
"""


class Page:
    """Families rendered as one page, as the stack's /metrics serves them."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(pages: list[tuple[dict[str, str], str]]) -> str:
    parsed = [(labels, text_string_to_metric_families(text)) for labels, text in pages]
    return generate_latest(Page(merge_families(parsed))).decode()  # type: ignore[arg-type]


def test_added_labels_keep_escapes_and_rename_a_clashing_own_label() -> None:
    extra = {"service": "worker", "instance": "worker"}
    assert merge([(extra, "m 1.0\n")]) == (
        '# HELP m \n# TYPE m untyped\nm{instance="worker",service="worker"} 1.0\n'
    )
    assert merge([(extra, 'm{a="x\\"}y",b="\\\\"} 2\n')]).endswith(
        'm{a="x\\"}y",b="\\\\",instance="worker",service="worker"} 2.0\n'
    )
    # A process's own label named like ours survives under another name.
    (family,) = text_string_to_metric_families('m{service="own"} 1\n')
    assert add_labels(family, {"service": "s"}).samples[0].labels == {
        "service": "s",
        "exported_service": "own",
    }


def test_merge_declares_each_family_once_with_every_sample_labelled() -> None:
    merged = merge(
        [
            ({"service": "tokenizer", "instance": "tokenizer-0"}, TOKENIZER_PAGE),
            ({"service": "tokenizer", "instance": "tokenizer-1"}, TOKENIZER_PAGE),
            ({"service": "scheduler", "instance": "scheduler"}, SCHEDULER_PAGE),
            ({"service": "worker", "instance": "worker"}, WORKER_PAGE),
        ]
    )
    assert merged == (
        "# HELP llmserve_requests_total Requests.\n"
        "# TYPE llmserve_requests_total counter\n"
        'llmserve_requests_total{code="OK",finish_reason="stop",instance="tokenizer-0",'
        'service="tokenizer"} 1.0\n'
        'llmserve_requests_total{code="OK",finish_reason="stop",instance="tokenizer-1",'
        'service="tokenizer"} 1.0\n'
        "# HELP llmserve_requests_rejected_total Rejected.\n"
        "# TYPE llmserve_requests_rejected_total counter\n"
        'llmserve_requests_rejected_total{instance="tokenizer-0",reason="invalid_argument",'
        'service="tokenizer"} 2.0\n'
        'llmserve_requests_rejected_total{instance="tokenizer-1",reason="invalid_argument",'
        'service="tokenizer"} 2.0\n'
        'llmserve_requests_rejected_total{instance="scheduler",reason="queue_full",'
        'service="scheduler"} 1.0\n'
        "# HELP llmserve_forward_seconds Forward.\n"
        "# TYPE llmserve_forward_seconds histogram\n"
        'llmserve_forward_seconds_bucket{instance="worker",le="0.1",service="worker"} 1.0\n'
        'llmserve_forward_seconds_bucket{instance="worker",le="+Inf",service="worker"} 2.0\n'
        'llmserve_forward_seconds_sum{instance="worker",service="worker"} 0.5\n'
        'llmserve_forward_seconds_count{instance="worker",service="worker"} 2.0\n'
    )


def test_merge_drops_samples_of_a_conflicting_type() -> None:
    other = "# TYPE llmserve_requests_total gauge\nllmserve_requests_total 5\n"
    merged = merge([({"service": "a"}, TOKENIZER_PAGE), ({"service": "b"}, other)])
    assert merged.count("# TYPE llmserve_requests_total") == 1
    assert 'service="b"' not in merged


# ---- HTTP -----------------------------------------------------------------------------------


def test_http_server_and_aggregator_over_loopback() -> None:
    registry = CollectorRegistry()
    Counter("llmserve_hits_total", "Hits.", registry=registry).inc(4)
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert response.read().decode() == render(registry)
        dead = MetricsServer(registry, "127.0.0.1", 0)
        dead_url = dead.url
        dead.stop()  # bound then closed: connection refused
        aggregate = generate_latest(
            Aggregator(
                [
                    ScrapeTarget("worker", "worker", server.url),
                    ScrapeTarget("scheduler", "scheduler", dead_url),
                ],
                timeout_s=5,
            )
        ).decode()
    finally:
        server.stop()
    assert 'llmserve_hits_total{instance="worker",service="worker"} 4.0' in aggregate
    assert 'llmserve_scrape_up{instance="worker",service="worker"} 1.0' in aggregate
    assert 'llmserve_scrape_up{instance="scheduler",service="scheduler"} 0.0' in aggregate


# ---- the tokenizer's per-request observations ----------------------------------------------


def test_a_message_of_k_tokens_counts_k_inter_token_gaps() -> None:

    def itl_count() -> float:
        value = tokenizer_metrics.REGISTRY.get_sample_value(
            "llmserve_inter_token_latency_seconds_count"
        )
        return value or 0.0

    before = itl_count()
    request = tokenizer_metrics.GenerateMetrics(started=0.0)
    request.on_tokens(3)  # the first token, then 2 gaps of 0 s inside the message
    request.on_tokens(2)
    assert itl_count() - before == 4


def test_a_request_is_counted_once_by_its_finish_reason_and_code() -> None:
    def count(reason: str, code: str) -> float:
        value = tokenizer_metrics.REGISTRY.get_sample_value(
            "llmserve_requests_total", {"finish_reason": reason, "code": code}
        )
        return value or 0.0

    finished, cancelled = count("length", "OK"), count("none", "CANCELLED")
    request = tokenizer_metrics.GenerateMetrics()
    request.finish_reason = "length"
    request.done(None)
    request.done("INTERNAL")  # a second end changes nothing
    gone = tokenizer_metrics.GenerateMetrics()
    gone.done(None)
    assert count("length", "OK") - finished == 1
    assert count("none", "CANCELLED") - cancelled == 1
