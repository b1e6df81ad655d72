"""Configuration of the tokenizer tier (the public API process): one frozen dataclass; the
flags and LLMSERVE_* environment fallbacks come from services.common.config_flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.serving_config import SERVICE_GROUPS
from services.tokenizer.routing.membership import SchedulerEntry, parse_scheduler_entries
from services.tokenizer.routing.policy import ROUTING_POLICIES, RoutingPolicy


@dataclass(frozen=True, slots=True)
class TokenizerConfig(*SERVICE_GROUPS["tokenizer"]):  # type: ignore[misc]
    """How the tokenizer tier listens, which schedulers it calls and which limits it enforces.
    The model and its context length are the workers': the schedulers pass them on."""

    host: str = "127.0.0.1"
    """Interface the public TextGeneration service listens on."""
    port: int = 50051
    """Port of the public service (0 = an ephemeral port, for tests)."""
    scheduler: str = "127.0.0.1:50060"
    """Schedulers, comma-separated: host:port (a fixed address) or dns:NAME:PORT (every A/AAAA
    address NAME resolves to, re-resolved every scheduler_resolve_s: a Kubernetes headless
    Service); the two kinds mix."""
    scheduler_resolve_s: float = 5.0
    """How often the dns: entries of scheduler are resolved again (schedulers join and
    leave)."""
    max_new_tokens_limit: int | None = None
    """Largest max_new_tokens a request may ask for; None = max_model_len."""
    max_stop_strings: int = 16
    """Most stop strings per request (each costs matching work on every delta)."""
    max_stop_string_len: int = 256
    """Longest stop string, in characters (bounds the text held back while matching)."""
    drain_s: float = 30.0
    """On SIGTERM, how long in-flight streams may run before the server stops; also how long
    a scheduler that left DNS may finish its streams before its channel closes."""
    warmup_poll_s: float = 0.5
    """How often to retry GetStats on the schedulers until one answers (then SERVING)."""
    redis_url: str | None = field(default=None, repr=False, metadata={"secret": True})
    """Redis for the prefix index and named prompts (redis://, rediss:// for TLS,
    [user]:password@ for AUTH and ACL); unset = routing by load only, named prompts local to
    this replica. It may carry a password: give it as LLMSERVE_REDIS_URL, not a flag."""
    routing: RoutingPolicy = "cache_aware"
    """cache_aware (longest cached prefix, then load), least_loaded or round_robin."""
    route_overload_queued: int = 8
    """A scheduler with this many queued requests is overloaded: cache-aware routing then
    sends the request to the least loaded one instead."""
    stats_poll_s: float = 0.1
    """How often each scheduler's load is read for routing."""
    prompt_ttl_s: int = 3600
    """Lifetime of a named prompt registered without ttl_s."""
    max_prompt_ttl_s: int = 7 * 24 * 3600
    """Longest ttl_s a named prompt may ask for."""
    pin_timeout_s: float = 120.0
    """How long RegisterPrompt waits for each scheduler to compute and pin the prompt."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics HTTP endpoint (0 = any free port); unset = none."""

    def __post_init__(self) -> None:
        self.check_public()
        self.check_disaggregation()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        self.scheduler_entries  # noqa: B018 - raises naming the entry at fault
        if self.scheduler_resolve_s <= 0:
            raise ValueError(f"scheduler_resolve_s must be > 0, got {self.scheduler_resolve_s}")
        if self.max_new_tokens_limit is not None and self.max_new_tokens_limit <= 0:
            raise ValueError(f"max_new_tokens_limit must be > 0, got {self.max_new_tokens_limit}")
        if self.max_stop_strings < 0 or self.max_stop_string_len <= 0:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_string_len > 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.route_overload_queued <= 0 or self.stats_poll_s <= 0:
            raise ValueError("route_overload_queued and stats_poll_s must be > 0")
        if self.drain_s < 0 or self.warmup_poll_s <= 0:
            raise ValueError("drain_s must be >= 0 and warmup_poll_s > 0")

    @property
    def scheduler_entries(self) -> tuple[SchedulerEntry, ...]:
        """'a:1, dns:pairs:50060' → ('a:1', DnsName('pairs', 50060))."""
        return parse_scheduler_entries(self.scheduler)
