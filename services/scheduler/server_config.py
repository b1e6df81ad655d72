"""The scheduler service's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class SchedulerServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 50060
    """Port of the Engine service (0 = any free port)."""
    worker: str = "127.0.0.1:50070"
    """Address of the worker this scheduler drives."""
    scheduler_id: str = ""
    """Name in stats and logs; empty = host:port."""
    max_num_seqs: int = 128
    """Most sequences in one step."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step (prefill chunks + decodes)."""
    watermark: float = 0.01
    """Fraction of KV blocks kept free at admission so running decodes can grow."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached full blocks across requests."""
    max_waiting_requests: int = 256
    """Bound of the waiting queue; beyond it Submit fails at once with RESOURCE_EXHAUSTED."""
    max_model_len: int | None = None
    """Longest prompt + output; unset = what the worker reports."""
    reconnect_max_s: float = 2.0
    """Longest wait between attempts to reach the worker."""
    drain_s: float = 30.0
    """On SIGTERM, how long in-flight streams may take to finish."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics HTTP endpoint (0 = any free port); unset = none."""
    redis_url: str | None = None
    """Redis for the shared prefix index and named prompts (redis://, rediss:// for TLS,
    user:password@ for ACL); unset = no index, routing falls back to load."""
    prefix_index_ttl_s: float = 600.0
    """Lifetime of a prefix-index entry in Redis unless refreshed (they are, while cached)."""
    max_pinned_fraction: float = 0.5
    """Most of the KV blocks that pinned named prompts may hold."""

    def scheduler_config(self, block_size: int, worker_max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=min(self.max_model_len or worker_max_model_len, worker_max_model_len),
            watermark=self.watermark,
            enable_prefix_caching=self.enable_prefix_caching,
            max_waiting_requests=self.max_waiting_requests,
            max_pinned_fraction=self.max_pinned_fraction,
        )
