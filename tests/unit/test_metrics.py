"""The metrics library's exposition text, byte for byte, and the stack's page merging."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest

from services.common.metrics import Registry
from services.common.metrics_aggregate import (
    Aggregator,
    ScrapeTarget,
    add_labels,
    merge_pages,
    parse_exposition,
)
from services.common.metrics_http import MetricsServer
from services.contracts.step import BatchPlan
from services.scheduler.metrics import step_kind


def test_counter_with_labels_renders_help_type_and_samples() -> None:
    registry = Registry()
    requests = registry.counter("llmserve_x_total", "Requests.", ("code", "reason"))
    requests.labels("OK", "stop").inc()
    requests.labels("OK", "stop").inc(2)
    requests.labels("CANCELLED", "none").inc()
    assert registry.render() == (
        "# HELP llmserve_x_total Requests.\n"
        "# TYPE llmserve_x_total counter\n"
        'llmserve_x_total{code="OK",reason="stop"} 3.0\n'
        'llmserve_x_total{code="CANCELLED",reason="none"} 1.0\n'
    )


def test_unlabelled_gauge_starts_at_zero_and_moves_both_ways() -> None:
    registry = Registry()
    gauge = registry.gauge("llmserve_in_flight", "In flight.")
    assert registry.render().endswith("llmserve_in_flight 0.0\n")
    gauge.inc()
    gauge.inc(2)
    gauge.dec()
    assert registry.render().endswith("llmserve_in_flight 2.0\n")
    gauge.set(0.25)
    assert registry.render() == (
        "# HELP llmserve_in_flight In flight.\n"
        "# TYPE llmserve_in_flight gauge\n"
        "llmserve_in_flight 0.25\n"
    )


def test_histogram_buckets_are_cumulative_with_inclusive_bounds() -> None:
    registry = Registry()
    latency = registry.histogram("llmserve_t_seconds", "Latency.", ("kind",), buckets=(0.1, 1.0))
    series = latency.labels("decode")
    for value in (0.05, 0.1, 0.5, 2.0):  # 0.1 sits exactly on a bound: le is inclusive
        series.observe(value)
    series.observe(0.5, count=2)
    assert registry.render() == (
        "# HELP llmserve_t_seconds Latency.\n"
        "# TYPE llmserve_t_seconds histogram\n"
        'llmserve_t_seconds_bucket{kind="decode",le="0.1"} 2.0\n'
        'llmserve_t_seconds_bucket{kind="decode",le="1.0"} 5.0\n'
        'llmserve_t_seconds_bucket{kind="decode",le="+Inf"} 6.0\n'
        'llmserve_t_seconds_sum{kind="decode"} 3.65\n'
        'llmserve_t_seconds_count{kind="decode"} 6.0\n'
    )


def test_unobserved_labelled_metric_renders_only_its_header() -> None:
    registry = Registry()
    registry.histogram("llmserve_h_seconds", "H.", ("kind",))
    assert registry.render() == (
        "# HELP llmserve_h_seconds H.\n# TYPE llmserve_h_seconds histogram\n"
    )


def test_label_values_and_help_are_escaped() -> None:
    registry = Registry()
    counter = registry.counter("llmserve_e_total", 'Back\\slash and\nnewline "quoted".', ("v",))
    counter.labels('a"b\\c\nd').inc()
    assert registry.render() == (
        '# HELP llmserve_e_total Back\\\\slash and\\nnewline "quoted".\n'
        "# TYPE llmserve_e_total counter\n"
        'llmserve_e_total{v="a\\"b\\\\c\\nd"} 1.0\n'
    )


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda r: r.counter("no_suffix", "x"), "_total"),
        (lambda r: r.gauge("bad-name", "x"), "invalid metric name"),
        (lambda r: r.gauge("g", "x", ("__reserved",)), "invalid label name"),
        (lambda r: r.histogram("h", "x", ("le",)), "reserved"),
        (lambda r: r.histogram("h", "x", buckets=(1.0, 0.5)), "increasing"),
    ],
)
def test_invalid_definitions_are_refused(make, error: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=error):
        make(Registry())


def test_misuse_is_refused() -> None:
    registry = Registry()
    counter = registry.counter("llmserve_c_total", "C.", ("a",))
    with pytest.raises(ValueError, match=r"use \.labels"):
        counter.inc()
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("x", "y")
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("x").inc(-1)
    with pytest.raises(ValueError, match="already registered"):
        registry.gauge("llmserve_c_total", "again")


def test_concurrent_increments_are_not_lost() -> None:
    registry = Registry()
    counter = registry.counter("llmserve_n_total", "N.", ("t",))
    histogram = registry.histogram("llmserve_v_seconds", "V.")

    def work() -> None:
        for _ in range(2000):
            counter.labels("same").inc()
            histogram.observe(0.01)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    text = registry.render()
    assert 'llmserve_n_total{t="same"} 8000.0' in text
    assert "llmserve_v_seconds_count 8000.0" in text


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


def test_parse_assigns_histogram_samples_to_their_family() -> None:
    families = parse_exposition(WORKER_PAGE + "untyped_thing 3\n")
    assert [(f.name, f.type, len(f.samples)) for f in families] == [
        ("llmserve_forward_seconds", "histogram", 4),
        ("untyped_thing", "untyped", 1),
    ]
    assert families[0].help == "Forward."


def test_add_labels_goes_first_and_keeps_escapes() -> None:
    extra = [("service", "worker"), ("instance", "worker")]
    assert add_labels("m 1.0", extra) == 'm{service="worker",instance="worker"} 1.0'
    assert (
        add_labels('m{a="x\\"}y",b="\\\\"} 2 1700000000', extra)
        == 'm{service="worker",instance="worker",a="x\\"}y",b="\\\\"} 2 1700000000'
    )
    # A process's own label named like ours survives under another name.
    assert add_labels('m{service="own"} 1', [("service", "s")]) == (
        'm{service="s",exported_service="own"} 1'
    )


def test_merge_declares_each_family_once_with_every_sample_labelled() -> None:
    merged = merge_pages(
        [
            ([("service", "tokenizer"), ("instance", "tokenizer-0")], TOKENIZER_PAGE),
            ([("service", "tokenizer"), ("instance", "tokenizer-1")], TOKENIZER_PAGE),
            ([("service", "scheduler"), ("instance", "scheduler")], SCHEDULER_PAGE),
            ([("service", "worker"), ("instance", "worker")], WORKER_PAGE),
        ]
    )
    assert merged == (
        "# HELP llmserve_requests_total Requests.\n"
        "# TYPE llmserve_requests_total counter\n"
        'llmserve_requests_total{service="tokenizer",instance="tokenizer-0",code="OK",'
        'finish_reason="stop"} 1.0\n'
        'llmserve_requests_total{service="tokenizer",instance="tokenizer-1",code="OK",'
        'finish_reason="stop"} 1.0\n'
        "# HELP llmserve_requests_rejected_total Rejected.\n"
        "# TYPE llmserve_requests_rejected_total counter\n"
        'llmserve_requests_rejected_total{service="tokenizer",instance="tokenizer-0",'
        'reason="invalid_argument"} 2.0\n'
        'llmserve_requests_rejected_total{service="tokenizer",instance="tokenizer-1",'
        'reason="invalid_argument"} 2.0\n'
        'llmserve_requests_rejected_total{service="scheduler",instance="scheduler",'
        'reason="queue_full"} 1.0\n'
        "# HELP llmserve_forward_seconds Forward.\n"
        "# TYPE llmserve_forward_seconds histogram\n"
        'llmserve_forward_seconds_bucket{service="worker",instance="worker",le="0.1"} 1.0\n'
        'llmserve_forward_seconds_bucket{service="worker",instance="worker",le="+Inf"} 2.0\n'
        'llmserve_forward_seconds_sum{service="worker",instance="worker"} 0.5\n'
        'llmserve_forward_seconds_count{service="worker",instance="worker"} 2.0\n'
    )


def test_merge_drops_samples_of_a_conflicting_type() -> None:
    other = "# TYPE llmserve_requests_total gauge\nllmserve_requests_total 5\n"
    merged = merge_pages([([("service", "a")], TOKENIZER_PAGE), ([("service", "b")], other)])
    assert merged.count("# TYPE llmserve_requests_total") == 1
    assert 'service="b"' not in merged


# ---- HTTP -----------------------------------------------------------------------------------


def test_http_server_and_aggregator_over_loopback() -> None:
    registry = Registry()
    registry.counter("llmserve_hits_total", "Hits.").inc(4)
    server = MetricsServer(registry.render, "127.0.0.1", 0).start()
    try:
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert response.read().decode() == registry.render()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=5)
        dead = MetricsServer(registry.render, "127.0.0.1", 0)
        dead_url = dead.url
        dead.stop()  # bound then closed: connection refused
        aggregate = Aggregator(
            [
                ScrapeTarget("worker", "worker", server.url),
                ScrapeTarget("scheduler", "scheduler", dead_url),
            ],
            timeout_s=5,
        ).render()
    finally:
        server.stop()
    assert 'llmserve_hits_total{service="worker",instance="worker"} 4.0' in aggregate
    assert 'llmserve_scrape_up{service="worker",instance="worker"} 1.0' in aggregate
    assert 'llmserve_scrape_up{service="scheduler",instance="scheduler"} 0.0' in aggregate
