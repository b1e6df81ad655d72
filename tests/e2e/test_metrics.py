"""Prometheus metrics through real processes: one request, then the stack's merged /metrics."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack, wait_until

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]


def parse_samples(page: str) -> list[Sample]:
    samples = []
    for line in page.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match is not None, line
        name, labels, value = match.groups()
        samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(
        value
        for sample_name, sample_labels, value in samples
        if sample_name == name and labels.items() <= sample_labels.items()
    )


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(response.read().decode("utf-8"))


def scrape_until(url: str, ready: Callable[[list[Sample]], bool]) -> tuple[str, list[Sample]]:
    """The tokenizer counts a call when its RPC ends, a moment after the client has read the
    last message: poll until the page shows it (bounded, never a timing assertion)."""

    def scraped() -> tuple[str, list[Sample]] | None:
        page = scrape(url)
        samples = parse_samples(page)
        return (page, samples) if ready(samples) else None

    try:
        return wait_until(scraped, 30, "the request in /metrics", interval_s=0.1)
    except TimeoutError:
        page = scrape(url)
        return page, parse_samples(page)


def documented_names() -> list[str]:
    """Metric names from the schema tables of docs/metrics.md (rows start with | `llmserve_)."""
    return re.findall(r"^\| `(llmserve_[a-z_]+)`", DOCS.read_text(), flags=re.MULTILINE)


def test_one_request_shows_up_in_the_merged_metrics(stack: RunningStack) -> None:
    url = stack.info["metrics"]
    assert url, "the ready file names the merged /metrics URL"
    responses = list(
        stack.text_stub().Generate(
            text_pb2.GenerateRequest(
                prompt="The capital of France is",
                request_id="metrics-e2e",
                sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=4),
            ),
            timeout=120,
        )
    )
    assert responses[-1].finish_reason

    page, samples = scrape_until(
        url, lambda s: total(s, "llmserve_e2e_request_latency_seconds_count") >= 1
    )

    # Each family is declared once, and every sample says which process it came from.
    declared = re.findall(r"^# TYPE (\S+) ", page, flags=re.MULTILINE)
    assert len(declared) == len(set(declared))
    assert all("service" in labels and "instance" in labels for _, labels, _ in samples)
    assert {labels["service"] for _, labels, _ in samples} == {"tokenizer", "scheduler", "worker"}
    assert total(samples, "llmserve_scrape_up") == len(stack.info["process_metrics"])

    names = documented_names()
    assert len(names) >= 20
    missing = [name for name in names if f"# TYPE {name} " not in page]
    assert not missing, f"documented but not served: {missing}"

    assert total(samples, "llmserve_requests_total", code="OK") >= 1
    assert total(samples, "llmserve_time_to_first_token_seconds_count") >= 1
    assert total(samples, "llmserve_inter_token_latency_seconds_count") >= 1
    assert total(samples, "llmserve_time_per_output_token_seconds_count") >= 1
    assert total(samples, "llmserve_e2e_request_latency_seconds_count") >= 1
    usage = responses[-1].usage
    assert total(samples, "llmserve_generation_tokens_total") >= usage.completion_tokens > 0
    assert total(samples, "llmserve_prompt_tokens_total") >= usage.prompt_tokens
    assert total(samples, "llmserve_queue_time_seconds_count") >= 1
    assert total(samples, "llmserve_step_duration_seconds_count", step_kind="prefill") >= 1
    assert total(samples, "llmserve_step_duration_seconds_count", step_kind="decode") >= 1
    assert total(samples, "llmserve_scheduler_requests_finished_total") >= 1
    assert total(samples, "llmserve_kv_cache_blocks_total", service="scheduler") > 0
    assert total(samples, "llmserve_worker_forward_seconds_count", service="worker") >= 1
    assert total(samples, "llmserve_worker_batch_tokens_sum") >= usage.prompt_tokens
    buckets: dict[str, list[float]] = {}
    for name, labels, value in samples:
        if name == "llmserve_time_to_first_token_seconds_bucket":
            buckets.setdefault(labels["instance"], []).append(value)
    assert buckets and all(counts == sorted(counts) for counts in buckets.values())  # cumulative

    # Each process's own page is reachable too, at the URL the ready file gives.
    for process_url in stack.info["process_metrics"].values():
        assert "# TYPE llmserve_" in scrape(process_url)
