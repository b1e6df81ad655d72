"""Sampling parameters of one request, validated once at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.errors import InvalidRequestError
from services.common.structured_output import StructuredOutput

# Most stop strings or stop ids a request may carry; guards the per-step checks.
MAX_STOP_ITEMS = 16
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. Defaults follow vLLM/OpenAI: temperature 1, no truncation."""

    temperature: float = 1.0
    """0 means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose probability sums to top_p, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in the prompt or output (CTRL-style), > 0."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token present in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output, in [-2, 2]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    max_new_tokens: int = 256
    """Upper bound on generated tokens."""
    min_new_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens are generated."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end generation (the model's EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int = 0
    """Return the log-probability of the sampled token and of this many top alternatives."""
    structured_output: StructuredOutput | None = None
    """Constrain the output to a JSON schema, a JSON object, a regex or a grammar; the request
    ends with "stop" (the model's EOS, the only token the grammar then allows) once complete."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, *, max_new_tokens_limit: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if self.max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequestError(
                "max_new_tokens",
                f"{self.max_new_tokens} is over the limit of {max_new_tokens_limit}",
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                "min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )
        if len(self.stop_token_ids) > MAX_STOP_ITEMS:
            raise InvalidRequestError(
                "stop_token_ids",
                f"at most {MAX_STOP_ITEMS} allowed, got {len(self.stop_token_ids)}",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "token ids must be >= 0")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.structured_output is not None:
            self.structured_output.validate()
            # A complete output allows only EOS: ignore_eos would leave no token to sample,
            # min_new_tokens would mask the only one allowed.
            if self.ignore_eos:
                raise InvalidRequestError("ignore_eos", "cannot be combined with structured output")
            if self.min_new_tokens:
                raise InvalidRequestError(
                    "min_new_tokens", "cannot be combined with structured output"
                )


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
