"""Configuration of the tokenizer tier (the public API process): one frozen dataclass; the
flags and LLMSERVE_* environment fallbacks come from services.common.config_flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """How the tokenizer tier listens, which schedulers it calls and which limits it enforces."""

    host: str = "127.0.0.1"
    """Interface the public TextGeneration service listens on."""
    port: int = 50051
    """Port of the public service (0 = an ephemeral port, for tests)."""
    scheduler: str = "127.0.0.1:50060"
    """Scheduler Engine address host:port; a comma-separated list is used round-robin."""
    model: str | None = None
    """The same .gguf file or HF directory as the worker's; None = the embedded model."""
    max_model_len: int | None = None
    """Longest prompt + output; None = the model's context length (never more than it)."""
    max_new_tokens_limit: int | None = None
    """Largest max_new_tokens a request may ask for; None = max_model_len."""
    max_stop_strings: int = 16
    """Most stop strings per request (each costs matching work on every delta)."""
    max_stop_string_len: int = 256
    """Longest stop string, in characters (bounds the text held back while matching)."""
    drain_s: float = 30.0
    """On SIGTERM, how long in-flight streams may run before the server stops."""
    warmup_poll_s: float = 0.5
    """How often to retry GetStats on the schedulers until one answers (then SERVING)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.scheduler_addresses:
            raise ValueError("at least one scheduler address (host:port) is required")
        for name in ("max_model_len", "max_new_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_stop_strings < 0 or self.max_stop_string_len <= 0:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_string_len > 0")
        if self.drain_s < 0 or self.warmup_poll_s <= 0:
            raise ValueError("drain_s must be >= 0 and warmup_poll_s > 0")

    @property
    def scheduler_addresses(self) -> tuple[str, ...]:
        """'a:1, b:2' → ('a:1', 'b:2')."""
        return tuple(part.strip() for part in self.scheduler.split(",") if part.strip())
