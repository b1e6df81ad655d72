"""Sampling parameters of one request, validated once at the edge."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.contracts.errors import InvalidRequestError, quoted, shortened
from services.contracts.structured_output import StructuredOutput

# Most stop strings or stop ids a request may carry; guards the per-step checks.
MAX_STOP_ITEMS = 16
MAX_LOGPROBS = 20
# OpenAI's bounds on logit_bias: at most 300 tokens, each bias in [-100, 100].
MAX_LOGIT_BIAS_ITEMS = 300
MAX_LOGIT_BIAS = 100.0

T = TypeVar("T")
# A JSON object's key naming a token id: decimal digits, optionally negative (validate() then
# names the negative id); no spaces, signs or underscores that int() would also take.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")

# Most choices (n) one request may ask for: each holds a seat and KV blocks of its own.
MAX_N = 16
MAX_TOP_K = 2**31 - 1
"""The wire's int32; any k at least the vocabulary's size keeps every token anyway."""
SEED_RANGE = (-(2**63), 2**63 - MAX_N)
"""The wire's int64, less the n - 1 that choice i adds to the seed."""
# Most draft tokens one step may verify for a sequence (speculative decoding by n-gram lookup).
MAX_SPECULATIVE_TOKENS = 16


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
    n: int = 1
    """Completions of the one prompt. The scheduler prefills the prompt once and forks the
    choices, which share its KV blocks; with a seed s, choice i samples with seed s + i."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those logits after the penalties, before temperature
    and greedy argmax; -100 bans a token, +100 all but forces it. A mapping is accepted and
    stored as pairs sorted by id (hashable, and equal whatever order it came in)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled (every other logit is -inf); None = all. Stored sorted
    and without duplicates."""
    structured_output: StructuredOutput | None = None
    """Constrain the output to a JSON schema, a JSON object, a regex or a grammar; the request
    ends with "stop" (the model's EOS, the only token the grammar then allows) once complete."""
    num_speculative_tokens: int | None = None
    """Most draft tokens (guessed from the context and recent requests' text) one step may
    verify for this request, 0 to MAX_SPECULATIVE_TOKENS; None = the server's
    --speculative-ngram; ignored under --no-speculation. The output is the same with or
    without (greedy: identical; sampled: the same distribution)."""

    def __post_init__(self) -> None:
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else tuple(bias)
        if all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
            # Ill-typed ids are left unsorted for validate() to name.
            pairs = _sorted_if_ints(pairs, key=lambda pair: pair[0])
        object.__setattr__(self, "logit_bias", pairs)
        if self.allowed_token_ids is not None:
            allowed = tuple(dict.fromkeys(self.allowed_token_ids))
            object.__setattr__(self, "allowed_token_ids", _sorted_if_ints(allowed))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def can_speculate(self) -> bool:
        """Whether drafts may be verified for this request at all. Not with logprobs (one
        token's alternatives per step) or a seeded sampled request (its draws are reproducible
        only one token per step). Structured output may: the worker cuts a draft where the
        grammar refuses it and masks every verified row."""
        return self.logprobs == 0 and (self.seed is None or self.is_greedy)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(
        self, *, max_new_tokens_limit: int | None = None, vocab_size: int | None = None
    ) -> None:
        """Raise InvalidRequestError naming the first bad field. With `vocab_size`, the ids of
        logit_bias and allowed_token_ids must also be inside the vocabulary."""
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError(
                "top_k", f"must be -1 (off) or in [0, {MAX_TOP_K}], got {self.top_k}"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidRequestError(
                "seed", f"must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}"
            )
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
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.num_speculative_tokens is not None and not (
            0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise InvalidRequestError(
                "num_speculative_tokens",
                f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}",
            )
        self._validate_logit_bias(vocab_size)
        self._validate_allowed_token_ids(vocab_size)
        if self.structured_output is not None:
            self.structured_output.validate()
            starts_after = self.structured_output.starts_after
            if vocab_size is not None and any(t >= vocab_size for t in starts_after):
                raise InvalidRequestError(
                    f"{self.structured_output.field}.starts_after",
                    f"token ids must be in [0, {vocab_size})",
                )
            # A complete output allows only EOS: ignore_eos would leave no token to sample,
            # min_new_tokens would mask the only one allowed.
            if self.ignore_eos:
                raise InvalidRequestError("ignore_eos", "cannot be combined with structured output")
            if self.min_new_tokens:
                raise InvalidRequestError(
                    "min_new_tokens", "cannot be combined with structured output"
                )

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ITEMS:
            raise InvalidRequestError(
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS_ITEMS} tokens allowed, got {len(self.logit_bias)}",
            )
        if not all(
            isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0])
            for pair in self.logit_bias
        ):
            raise InvalidRequestError("logit_bias", "must map token ids to numbers")
        outside = [
            token_id
            for token_id, _ in self.logit_bias
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size)
        ]
        if len(outside) > 1:
            # Every id outside the vocabulary at once, not only the first.
            ids = ", ".join(str(token_id) for token_id in outside)
            bounds = f"[0, {vocab_size})" if vocab_size is not None else "(ids are >= 0)"
            raise InvalidRequestError(
                "logit_bias", f"token ids {ids} are outside the vocabulary {bounds}"
            )
        seen: set[int] = set()
        for pair in self.logit_bias:
            token_id, bias = pair
            name = f"logit_bias[{token_id}]"
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise InvalidRequestError(name, _outside_vocabulary(token_id, vocab_size))
            if token_id in seen:
                raise InvalidRequestError(name, "token id given twice")
            seen.add(token_id)
            if isinstance(bias, bool):
                raise InvalidRequestError(name, f"must be a number, got {bias!r}")
            _finite(name, bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    name, f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                )

    def _validate_allowed_token_ids(self, vocab_size: int | None) -> None:
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if not allowed:
            raise InvalidRequestError("allowed_token_ids", "must not be empty when given")
        if vocab_size is not None and len(allowed) > vocab_size:
            raise InvalidRequestError(
                "allowed_token_ids",
                f"at most the vocabulary size ({vocab_size}) ids allowed, got {len(allowed)}",
            )
        for token_id in allowed:
            if not _is_int(token_id):
                raise InvalidRequestError(
                    "allowed_token_ids", f"token ids must be integers, got {token_id!r}"
                )
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise InvalidRequestError(
                    "allowed_token_ids", _outside_vocabulary(token_id, vocab_size)
                )


def logit_bias_from_json(
    value: object, field_name: str = "logit_bias"
) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, a JSON object from token ids as strings ("50256") to numbers, as
    (id, bias) pairs; null is none. Ranges are validate()'s job; this checks the shape."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequestError(field_name, "must be an object mapping token ids to numbers")
    # Every bad key is named at once, so a caller fixes the map in one round trip.
    bad_keys = [
        quoted(str(key))
        for key in value
        if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key))
    ]
    if bad_keys:
        raise InvalidRequestError(
            field_name, f"keys must be token ids (integers), got {', '.join(bad_keys)}"
        )
    pairs: list[tuple[int, float]] = []
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequestError(
                f"{field_name}[{key}]", f"must be a number, got {shortened(repr(bias), 40)}"
            )
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _itself(item: Any) -> Any:
    return item


def _sorted_if_ints(items: tuple[T, ...], key: Callable[[T], Any] = _itself) -> tuple[T, ...]:
    """`items` sorted when their ids compare; as given otherwise, for validate() to refuse."""
    try:
        return tuple(sorted(items, key=key))
    except TypeError:
        return items


def _outside_vocabulary(token_id: int, vocab_size: int | None) -> str:
    if vocab_size is None:
        return f"token id {token_id} must be >= 0"
    return f"token id {token_id} is outside the vocabulary [0, {vocab_size})"


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
