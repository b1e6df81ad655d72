"""Configuration of the tokenizer tier (the public API process): one frozen dataclass, built
from CLI flags with LLMSERVE_* environment variables as fallbacks."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

ENV_PREFIX = "LLMSERVE_"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """How the tokenizer tier listens, which schedulers it calls and which limits it enforces."""

    host: str = "127.0.0.1"
    """Interface the public TextGeneration service listens on."""
    port: int = 50051
    """Port of the public service (0 = an ephemeral port, for tests)."""
    schedulers: tuple[str, ...] = ("127.0.0.1:50060",)
    """host:port of each scheduler's Engine service; requests go round-robin over them."""
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
        if not self.schedulers or any(not address for address in self.schedulers):
            raise ValueError("at least one scheduler address (host:port) is required")
        for name in ("max_model_len", "max_new_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_stop_strings < 0 or self.max_stop_string_len <= 0:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_string_len > 0")
        if self.drain_s < 0 or self.warmup_poll_s <= 0:
            raise ValueError("drain_s must be >= 0 and warmup_poll_s > 0")


def parse_scheduler_list(value: str) -> tuple[str, ...]:
    """'a:1, b:2' → ('a:1', 'b:2')."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Flags default to None so that the environment, then the dataclass default, fill in."""
    env = ENV_PREFIX
    parser.add_argument("--host", default=None, help=f"listen address ({env}HOST; 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help=f"listen port ({env}PORT; 50051)")
    parser.add_argument(
        "--scheduler",
        default=None,
        help=f"scheduler Engine address(es), comma-separated, used round-robin "
        f"({env}SCHEDULER; 127.0.0.1:50060)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"GGUF file or HF directory, the worker's ({env}MODEL; embedded SmolLM2-135M)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"prompt + output limit ({env}MAX_MODEL_LEN; the model's context length)",
    )
    parser.add_argument(
        "--max-new-tokens-limit",
        type=int,
        default=None,
        help=f"largest max_new_tokens accepted ({env}MAX_NEW_TOKENS_LIMIT; max model len)",
    )
    parser.add_argument(
        "--max-stop-strings",
        type=int,
        default=None,
        help=f"stop strings per request ({env}MAX_STOP_STRINGS; 16)",
    )
    parser.add_argument(
        "--max-stop-string-len",
        type=int,
        default=None,
        help=f"characters per stop string ({env}MAX_STOP_STRING_LEN; 256)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help=f"seconds in-flight streams get on SIGTERM ({env}DRAIN_S; 30)",
    )


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> TokenizerConfig:
    """Flag if given, else LLMSERVE_<FLAG> from the environment, else the default."""
    environ = os.environ if environ is None else environ
    defaults = {f.name: f.default for f in fields(TokenizerConfig)}

    def pick(flag: str, cast: Callable[[str], T]) -> Any:
        value = getattr(args, flag, None)
        if value is not None:
            return value
        raw = environ.get(ENV_PREFIX + flag.upper())
        if raw not in (None, ""):
            try:
                return cast(raw)
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}{flag.upper()}={raw!r}: {exc}") from exc
        return defaults.get(flag)

    scheduler = pick("scheduler", str)
    return TokenizerConfig(
        host=pick("host", str),
        port=pick("port", int),
        schedulers=parse_scheduler_list(scheduler) if scheduler else defaults["schedulers"],
        model=pick("model", str),
        max_model_len=pick("max_model_len", int),
        max_new_tokens_limit=pick("max_new_tokens_limit", int),
        max_stop_strings=pick("max_stop_strings", int),
        max_stop_string_len=pick("max_stop_string_len", int),
        drain_s=pick("drain_s", float),
    )
