"""Metrics per LoRA adapter: requests, output tokens, and what its load took, so an operator
sees which adapters are used and what they cost. Adapters are labels: the first
MAX_LORA_LABELS names keep their own, later ones share "other"; the base model is "base"."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from services.common.metrics import BoundedLabels
from services.contracts.lora import LoraAdapterInfo
from services.scheduler.metrics import REGISTRY

MAX_LORA_LABELS = 64

LORA_REQUESTS = Counter(
    "llmserve_scheduler_lora_requests_total",
    "Requests admitted to the queue, by LoRA adapter (base: none).",
    ("lora",),
    registry=REGISTRY,
)
LORA_GENERATION_TOKENS = Counter(
    "llmserve_scheduler_lora_generation_tokens_total",
    "Tokens sampled and delivered to requests, by LoRA adapter (base: none).",
    ("lora",),
    registry=REGISTRY,
)
LORA_LOAD_SECONDS = Gauge(
    "llmserve_scheduler_lora_load_seconds",
    "What the worker took to read, check and place the adapter, at its load.",
    ("lora",),
    registry=REGISTRY,
)
LORA_LOADED = Gauge(
    "llmserve_scheduler_lora_loaded",
    "1 while the adapter is loaded on this scheduler's worker.",
    ("lora",),
    registry=REGISTRY,
)

lora_label = BoundedLabels(MAX_LORA_LABELS, empty="base")


def on_admitted(lora_name: str) -> None:
    LORA_REQUESTS.labels(lora_label(lora_name)).inc()


def on_tokens(lora_name: str, num_tokens: int) -> None:
    if num_tokens:
        LORA_GENERATION_TOKENS.labels(lora_label(lora_name)).inc(num_tokens)


def on_loaded(info: LoraAdapterInfo) -> None:
    label = lora_label(info.name)
    LORA_LOAD_SECONDS.labels(label).set(info.load_ms / 1000)
    LORA_LOADED.labels(label).set(1)


def on_unloaded(lora_name: str) -> None:
    LORA_LOADED.labels(lora_label(lora_name)).set(0)
