"""The worker's metrics: forward time and batch shape, once per step.

Process-wide, like the logging configuration: one registry per process, scraped at /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics import LATENCY_BUCKETS_S, SIZE_BUCKETS
from services.contracts.step import BatchPlan

REGISTRY = CollectorRegistry()

FORWARD_DURATION = Histogram(
    "llmserve_worker_forward_seconds",
    "One step in the worker: apply the plan, forward, sample (the runner's wall time).",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
BATCH_SEQUENCES = Histogram(
    "llmserve_worker_batch_sequences",
    "Sequences scheduled in one step.",
    buckets=SIZE_BUCKETS,
    registry=REGISTRY,
)
BATCH_TOKENS = Histogram(
    "llmserve_worker_batch_tokens",
    "Tokens computed in one step (prefill chunks + decodes).",
    buckets=SIZE_BUCKETS,
    registry=REGISTRY,
)
STEPS = Counter(
    "llmserve_worker_steps_total",
    "Forward steps by how they ran: a fused C++ decode, a compiled decode graph or eager ops.",
    ["mode"],
    registry=REGISTRY,
)

GRAMMAR_PREPARES = Counter(
    "llmserve_worker_grammar_prepares_total",
    "PrepareGrammar calls by outcome: compiled now, found compiled, or refused.",
    ["outcome"],
    registry=REGISTRY,
)

# Disaggregation (services/worker/kv_transfer_service.py): prompt KV between workers.
KV_TRANSFER_BYTES = Counter(
    "llmserve_kv_transfer_bytes_total",
    "KV block bytes moved between workers: sent by a prefill worker, received by a decode one.",
    ["direction"],
    registry=REGISTRY,
)
KV_TRANSFER_DURATION = Histogram(
    "llmserve_kv_transfer_seconds",
    "One prompt's KV transfer, from the first chunk to the last write (either side's view).",
    ["direction"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
KV_TRANSFERS = Counter(
    "llmserve_kv_transfers_total",
    "KV transfers by direction and outcome: ok, or failed (refused, given up, unreachable).",
    ["direction", "outcome"],
    registry=REGISTRY,
)
KV_TRANSFERS_SHM = Counter(
    "llmserve_kv_transfers_shm_total",
    "Successful KV transfers whose bytes went through a shared-memory file (both workers on "
    "one host) rather than the gRPC stream.",
    ["direction"],
    registry=REGISTRY,
)

# KV disk tier (services/worker/kv_disk_tier.py): full blocks kept on disk below the pool.
KV_DISK_BLOCKS = Counter(
    "llmserve_kv_disk_blocks_total",
    "KV blocks by operation: written to disk, read back (a hit), refused (bad header or"
    " checksum, deleted), evicted (LRU by bytes), dropped (write queue full or tier off).",
    ["op"],
    registry=REGISTRY,
)
KV_DISK_BYTES = Counter(
    "llmserve_kv_disk_bytes_total",
    "KV block bytes written to or read from the disk tier.",
    ["op"],
    registry=REGISTRY,
)
KV_DISK_LOAD_DURATION = Histogram(
    "llmserve_kv_disk_load_seconds",
    "Reading and checking one block file from the disk tier.",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
KV_DISK_ERRORS = Counter(
    "llmserve_kv_disk_errors_total",
    "Disk tier failures (full, vanished, unreadable); after one the worker serves without it.",
    ["op"],
    registry=REGISTRY,
)


def on_kv_transfer(
    direction: str, num_bytes: int, seconds: float, ok: bool, shm: bool = False
) -> None:
    KV_TRANSFERS.labels(direction, "ok" if ok else "failed").inc()
    if ok:
        KV_TRANSFER_BYTES.labels(direction).inc(num_bytes)
        KV_TRANSFER_DURATION.labels(direction).observe(seconds)
        if shm:
            KV_TRANSFERS_SHM.labels(direction).inc()


def on_step(plan: BatchPlan, forward_s: float, mode: str) -> None:
    if plan.is_empty:
        return  # a plan that only drops sequences runs no forward
    STEPS.labels(mode).inc()
    FORWARD_DURATION.observe(forward_s)
    BATCH_SEQUENCES.observe(len(plan.num_scheduled_tokens))
    BATCH_TOKENS.observe(plan.total_num_scheduled_tokens)
