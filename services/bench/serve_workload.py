"""What `llmserve bench serve` sends and when: seeded prompt sets (synthetic, shared-prefix,
ShareGPT) and Poisson arrival times. Pure apart from reading the ShareGPT file."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench.common import random_prompts

# ShareGPT filters, as vLLM's benchmark: drop turns too short to time and pairs too long to fit.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class Sample:
    """One request to send. Synthetic prompts are token ids; ShareGPT prompts stay text (so any
    server tokenizes them its own way) with `prompt_len` counted by a local tokenizer."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    prompt_text: str | None = None
    prompt_len_hint: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_text is None else self.prompt_len_hint


def synthetic(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[Sample]:
    return [Sample(tuple(p), output_len) for p in random_prompts(num_prompts, input_len, seed=seed)]


def shared_prefix(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int,
    num_prefixes: int = 1,
) -> list[Sample]:
    """Users sharing a system prompt: request i gets prefix i % num_prefixes (prefix_len random
    tokens) followed by its own suffix_len random tokens."""
    prefixes = random_prompts(num_prefixes, prefix_len, seed=seed)
    suffixes = random_prompts(num_prompts, suffix_len, seed=seed + 1_000_003)
    return [
        Sample((*prefixes[i % num_prefixes], *suffix), output_len)
        for i, suffix in enumerate(suffixes)
    ]


def sharegpt(
    path: Path,
    num_prompts: int,
    count_tokens: Callable[[str], int],
    seed: int,
    output_len: int | None = None,
) -> list[Sample]:
    """ShareGPT conversations: the first human turn is the prompt, the length of the reply that
    follows it (in tokens) the output length unless `output_len` overrides it. Conversations
    are shuffled with `seed`; pairs failing the length filters are skipped."""
    with path.open(encoding="utf-8") as source:
        conversations: list[Any] = json.load(source)
    # Sorted by random keys rather than rng.shuffle: Random.random() is the one sequence
    # Python promises to keep across versions.
    rng = random.Random(seed)
    keys = [rng.random() for _ in conversations]
    order = sorted(range(len(conversations)), key=keys.__getitem__)
    samples: list[Sample] = []
    for index in order:
        if len(samples) == num_prompts:
            break
        pair = _first_exchange(conversations[index])
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = count_tokens(prompt)
        reply_len = output_len or count_tokens(reply)
        if (
            min(prompt_len, reply_len) < SHAREGPT_MIN_TOKENS
            or prompt_len > SHAREGPT_MAX_PROMPT_TOKENS
            or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_TOKENS
        ):
            continue
        samples.append(Sample((), reply_len, prompt_text=prompt, prompt_len_hint=prompt_len))
    if len(samples) < num_prompts:
        raise ValueError(
            f"{path} has only {len(samples)} usable conversations, {num_prompts} were asked for"
        )
    return samples


def _first_exchange(conversation: Any) -> tuple[str, str] | None:
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in itertools.pairwise(turns):
        if (
            isinstance(turn, dict)
            and isinstance(reply, dict)
            and turn.get("from") in ("human", "user")
            and reply.get("from") in ("gpt", "assistant", "chatgpt", "bard")
        ):
            return str(turn.get("value", "")), str(reply.get("value", ""))
    return None


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `request_rate` requests/s
    (exponential gaps, first request at 0), or all at 0 for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(num_requests - 1):
        offsets.append(offsets[-1] - math.log(1.0 - rng.random()) / request_rate)
    return offsets[:num_requests]
