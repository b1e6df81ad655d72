"""The scheduler service's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.common.serving_config import SERVICE_GROUPS
from services.scheduler.config import AdmissionConfig, SchedulerConfig


@dataclass(frozen=True, slots=True)
class SchedulerServerConfig(*SERVICE_GROUPS["scheduler"], AdmissionConfig):  # type: ignore[misc]
    """The batching and step-loop groups (services.common.serving_config) and the core's
    admission settings, plus how the server listens and whom it talks to."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback: only this machine's tokenizer tier may reach it;
    0.0.0.0 in a container, behind the stack's network and its internal secret)."""
    port: int = 50060
    """Port of the Scheduler service (0 = any free port)."""
    worker: str = "127.0.0.1:50070"
    """Address of the worker this scheduler drives."""
    worker_advertise_address: str = ""
    """This pair's worker as other pairs' workers reach it: where a prefill pair pushes the KV
    of this (decode) pair's requests (docs/disaggregation.md). Empty: --worker, right on one
    host and in compose; in Kubernetes the pod's IP and the worker's port."""
    scheduler_id: str = ""
    """Name in stats and logs; empty = host:port."""
    max_model_len: int | None = None
    """Longest prompt + output; unset = what the worker reports (never more than it)."""
    reconnect_max_s: float = 2.0
    """Longest wait between attempts to reach the worker."""
    drain_s: float = 30.0
    """On SIGTERM, how long in-flight streams may take to finish."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics HTTP endpoint (0 = any free port); unset = none."""
    redis_url: str | None = field(default=None, repr=False, metadata={"secret": True})
    """Redis for the shared prefix index and named prompts (redis://, rediss:// for TLS,
    [user]:password@ for AUTH and ACL); unset = no index, routing falls back to load. It may
    carry a password: give it as LLMSERVE_REDIS_URL rather than a flag anyone can read in ps."""
    prefix_index_ttl_s: float = 600.0
    """Lifetime of a prefix-index entry in Redis unless refreshed (they are, while cached)."""
    role: Literal["both", "prefill", "decode"] = "both"
    """What this pair serves (docs/disaggregation.md): both (prefill and decode, the
    default), prefill (prompts whose KV then moves to a decode pair) or decode (requests
    the tokenizer tier routes, prefilled here or on a prefill pair). Routing reads it from
    GetStats."""

    def __post_init__(self) -> None:
        self.check_speculation()
        self.check_disaggregation()

    def scheduler_config(
        self, block_size: int, worker_max_model_len: int, *, batch_invariant: bool = False
    ) -> SchedulerConfig:
        """The core's settings for a worker of this block size and context, batch-invariant
        or not (which decides whether drafts are on by default)."""
        return SchedulerConfig(
            block_size=block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=min(self.max_model_len or worker_max_model_len, worker_max_model_len),
            watermark=self.watermark,
            enable_prefix_caching=self.enable_prefix_caching,
            fair_share=self.fair_share,
            max_waiting_requests=self.max_waiting_requests,
            max_pinned_fraction=self.max_pinned_fraction,
            speculation=self.speculation is not False,
            speculative_ngram=self.default_draft_limit(batch_invariant),
            debug_checks=self.debug_checks,
        )
