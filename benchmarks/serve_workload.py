"""What `llmserve bench serve` sends and when: seeded prompt sets (synthetic with fixed,
uniform, normal or file-given lengths, the same as text, shared-prefix, ShareGPT) and Poisson
arrival times. Pure apart from reading the ShareGPT and lengths files."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import SAFE_TOKEN_RANGE, random_prompts, uniform_int

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


LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "normal")


def draw_lengths(
    num_prompts: int, mean_len: int, distribution: str, spread: float, rng: random.Random
) -> list[int]:
    """`num_prompts` lengths around `mean_len`: fixed; uniform in mean * [1 - spread,
    1 + spread]; or normal with standard deviation spread * mean. Rounded, at least 1.
    Built on Random.random() alone (Box-Muller for the normal), like every draw here."""
    if distribution not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"length distribution is one of {LENGTH_DISTRIBUTIONS}: {distribution!r}")
    if spread < 0 or (distribution == "uniform" and spread > 1):
        raise ValueError(f"length spread must be >= 0 (uniform: <= 1), got {spread}")
    lengths = []
    for _ in range(num_prompts):
        if distribution == "fixed":
            value = float(mean_len)
        elif distribution == "uniform":
            value = mean_len * (1 - spread + 2 * spread * rng.random())
        else:
            radius = math.sqrt(-2 * math.log(1 - rng.random()))
            value = mean_len * (1 + spread * radius * math.cos(2 * math.pi * rng.random()))
        lengths.append(max(1, round(value)))
    return lengths


def synthetic_lengths(
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    distribution: str = "fixed",
    spread: float = 0.0,
) -> list[tuple[int, int]]:
    """(prompt, output) lengths of a synthetic workload, both drawn from `distribution`."""
    rng = random.Random(seed + 2_000_003)  # apart from the prompt tokens' stream
    inputs = draw_lengths(num_prompts, input_len, distribution, spread, rng)
    outputs = draw_lengths(num_prompts, output_len, distribution, spread, rng)
    return list(zip(inputs, outputs, strict=True))


def lengths_file(path: Path, num_prompts: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths from a file, cycled to `num_prompts`: a JSON list of
    [input_len, output_len] pairs or {"input_len", "output_len"} objects, or CSV lines
    `input_len,output_len` (a header line is skipped)."""
    text = path.read_text(encoding="utf-8")
    pairs: list[tuple[int, int]] = []
    if path.suffix == ".json":
        for entry in json.loads(text):
            if isinstance(entry, dict):
                pairs.append((int(entry["input_len"]), int(entry["output_len"])))
            else:
                pairs.append((int(entry[0]), int(entry[1])))
    else:
        for line in text.splitlines():
            cells = [cell.strip() for cell in line.split(",")]
            if len(cells) >= 2 and cells[0].isdigit() and cells[1].isdigit():
                pairs.append((int(cells[0]), int(cells[1])))
    if not pairs or min(min(pair) for pair in pairs) < 1:
        raise ValueError(f"{path}: no (input_len >= 1, output_len >= 1) pairs")
    return [pairs[i % len(pairs)] for i in range(num_prompts)]


def synthetic_of_lengths(lengths: Sequence[tuple[int, int]], seed: int) -> list[Sample]:
    """Random-token prompts of the given (prompt, output) lengths."""
    rng = random.Random(seed)
    low, high = SAFE_TOKEN_RANGE
    return [
        Sample(tuple(uniform_int(rng, low, high - 1) for _ in range(input_len)), output_len)
        for input_len, output_len in lengths
    ]


# Rounds of decode -> encode -> cut/extend before a text prompt is accepted at its length.
TEXT_PROMPT_ROUNDS = 8


def synthetic_text(
    lengths: Sequence[tuple[int, int]],
    seed: int,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
) -> list[Sample]:
    """Random-token prompts of the given (prompt, output) lengths sent as text, for servers
    that take no token ids (llama-cpp-python). Decoded ids do not re-encode to the same count
    (neighbouring pieces merge), so each prompt is re-encoded, cut or extended with more random
    ids, and decoded again until the text encodes to its length (or the rounds run out:
    `prompt_len` says what it is)."""
    ids_samples = synthetic_of_lengths(lengths, seed)
    spare_samples = synthetic_of_lengths(
        [(TEXT_PROMPT_ROUNDS * input_len, 0) for input_len, _ in lengths], seed + 1
    )
    samples = []
    for sample, spare_sample in zip(ids_samples, spare_samples, strict=True):
        input_len, spare = sample.prompt_len, list(spare_sample.prompt_token_ids)
        text = decode(list(sample.prompt_token_ids))
        for round_index in range(TEXT_PROMPT_ROUNDS):
            encoded = encode(text)
            if len(encoded) == input_len:
                break
            more = spare[round_index * input_len : (round_index + 1) * input_len]
            text = decode((encoded + more)[:input_len])
        samples.append(
            Sample((), sample.output_len, prompt_text=text, prompt_len_hint=len(encode(text)))
        )
    return samples


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
