"""The pure parts of `llmserve bench prefix-tiers`: the conversations, the KV pool that holds a
few of them, what a run's records add up to, and the ratios the targets name.

A conversation is a long history and then turns; turn t's prompt is the history plus every
turn segment up to t, so each turn extends the one before (a chat client resending the whole
conversation):

    turn 0:  [ history (H tokens) ][ seg 0 ]
    turn 1:  [ history (H tokens) ][ seg 0 ][ seg 1 ]
    turn 2:  [ history (H tokens) ][ seg 0 ][ seg 1 ][ seg 2 ]

Turns are sent turn-major (turn 0 of every conversation, then turn 1 of each ...), so with a
pool holding only a few conversations, LRU has evicted a conversation's blocks before its next
turn: the pool alone misses, a tier below it can hit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import format_table, mean, random_prompts
from benchmarks.serve_metrics import RequestRecord

GiB = 1 << 30

HIT_RATE_TARGET = 0.85
"""(a) cached prompt tokens / prompt tokens with the tiers, at least."""
TTFT_TIERS_TARGET = 0.3
"""(a) mean TTFT with the tiers / without, at most."""
RESTART_CACHED_TARGET = 0.90
"""(b) after a restart, the first turn's cached share of its prompt, at least."""
TTFT_RESTART_TARGET = 0.2
"""(b) the first turn's mean TTFT after a restart / on a cold start, at most."""
CROSS_PAIR_CACHED_TARGET = 0.5
"""(c) the cached share of the turn served on the pair that did not compute its prefix, at
least (any cached token shows the fetch worked; half the prompt shows it covers the history)."""
TTFT_CROSS_PAIR_TARGET = 0.5
"""(c) that turn's mean TTFT with the prefix fetched / recomputed, at most."""


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int
    turn: int
    prompt_token_ids: tuple[int, ...]


def conversations(
    num_conversations: int, turns: int, history_tokens: int, turn_tokens: int, seed: int = 0
) -> list[list[Turn]]:
    """Each conversation's turns (`turns` + 1: the last is the turn a client sends after a
    restart, never sent before it), from seeded random token ids."""
    if min(num_conversations, turns, history_tokens, turn_tokens) < 1:
        raise ValueError("conversations, turns, history and turn tokens must each be >= 1")
    result: list[list[Turn]] = []
    for index in range(num_conversations):
        # A seed per conversation: one conversation's ids do not depend on how many there are.
        history, *segments = random_prompts(turns + 2, history_tokens, seed * 1_000_003 + index)
        prompt = list(history)
        own: list[Turn] = []
        for turn, segment in enumerate(segments):
            prompt += segment[:turn_tokens]
            own.append(Turn(index, turn, tuple(prompt)))
        result.append(own)
    return result


def turn_major(convs: Sequence[Sequence[Turn]], turns: int) -> list[Turn]:
    """Turns 0..turns-1 in the order sent: turn 0 of every conversation, then turn 1, ..."""
    return [conv[turn] for turn in range(turns) for conv in convs]


def cross_pair_turns(convs: Sequence[Sequence[Turn]]) -> list[Turn]:
    """Each conversation's first two turns, back to back (the second extends the first)."""
    return [turn for conv in convs for turn in conv[:2]]


def resume_turns(convs: Sequence[Sequence[Turn]]) -> list[Turn]:
    """The turn each conversation sends first after a restart: its last."""
    return [conv[-1] for conv in convs]


def kv_bytes_per_token(metadata: Mapping[str, Any], kv_dtype_bytes: int) -> int:
    """K and V of every layer for one token, from a GGUF file's metadata."""
    arch = metadata["general.architecture"]
    layers = int(metadata[f"{arch}.block_count"])
    heads = int(metadata[f"{arch}.attention.head_count"])
    kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        metadata.get(
            f"{arch}.attention.key_length", int(metadata[f"{arch}.embedding_length"]) // heads
        )
    )
    return 2 * layers * kv_heads * head_dim * kv_dtype_bytes


def pool_gib(
    bytes_per_token: int, conversation_tokens: int, conversations_held: float, block_size: int
) -> float:
    """A --kv-cache-gib whose pool holds `conversations_held` conversations of
    `conversation_tokens` (whole blocks)."""
    blocks = math.ceil(conversation_tokens / block_size) * conversations_held
    return math.ceil(blocks) * block_size * bytes_per_token / GiB


@dataclass(frozen=True, slots=True)
class RunSummary:
    label: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    mean_ttft_ms: float
    errors: int

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else math.nan


def summarize(label: str, records: Sequence[RequestRecord]) -> RunSummary:
    done = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return RunSummary(
        label=label,
        requests=len(records),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done),
        mean_ttft_ms=mean(ttfts) * 1000 if ttfts else math.nan,
        errors=len(records) - len(done),
    )


def runs_table(runs: Sequence[RunSummary]) -> str:
    return format_table(
        ["run", "requests", "prompt tokens", "cached", "hit rate %", "mean TTFT ms", "errors"],
        [
            [
                r.label,
                r.requests,
                r.prompt_tokens,
                r.cached_prompt_tokens,
                r.hit_rate * 100,
                r.mean_ttft_ms,
                r.errors,
            ]
            for r in runs
        ],
    )


@dataclass(frozen=True, slots=True)
class Ratio:
    scenario: str
    measure: str
    value: float
    target: float
    at_least: bool
    """True: the value must be >= the target; False: <=."""
    percent: bool = False

    @property
    def met(self) -> bool | None:
        if math.isnan(self.value):
            return None
        return self.value >= self.target if self.at_least else self.value <= self.target

    def cells(self) -> list[object]:
        unit, scale = ("%", 100) if self.percent else ("x", 1)
        value = (
            "-"
            if math.isnan(self.value)
            else f"{self.value * scale:.{1 if self.percent else 2}f}{unit}"
        )
        bound = f"{'>=' if self.at_least else '<='} {self.target * scale:g}{unit}"
        met = {True: "yes", False: "no", None: "-"}[self.met]
        return [self.scenario, self.measure, value, bound, met]


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def tier_ratios(
    tiers: RunSummary,
    pool_only: RunSummary,
    restarted: RunSummary,
    cold: RunSummary,
    fetched: RunSummary,
    recomputed: RunSummary,
) -> list[Ratio]:
    """The six ratios the targets name, in the order of the scenarios."""
    return [
        Ratio(
            "(a) conversations",
            "hit rate with the tiers",
            tiers.hit_rate,
            HIT_RATE_TARGET,
            True,
            True,
        ),
        Ratio(
            "(a) conversations",
            "mean TTFT, tiers / pool only",
            ratio(tiers.mean_ttft_ms, pool_only.mean_ttft_ms),
            TTFT_TIERS_TARGET,
            False,
        ),
        Ratio(
            "(b) restart",
            "first turn cached share",
            restarted.hit_rate,
            RESTART_CACHED_TARGET,
            True,
            True,
        ),
        Ratio(
            "(b) restart",
            "first turn mean TTFT, restarted / cold",
            ratio(restarted.mean_ttft_ms, cold.mean_ttft_ms),
            TTFT_RESTART_TARGET,
            False,
        ),
        Ratio(
            "(c) cross-pair",
            "cached share on pair B",
            fetched.hit_rate,
            CROSS_PAIR_CACHED_TARGET,
            True,
            True,
        ),
        Ratio(
            "(c) cross-pair",
            "mean TTFT on pair B, fetched / recomputed",
            ratio(fetched.mean_ttft_ms, recomputed.mean_ttft_ms),
            TTFT_CROSS_PAIR_TARGET,
            False,
        ),
    ]


def ratios_table(ratios: Sequence[Ratio]) -> str:
    return format_table(
        ["scenario", "measure", "value", "target", "met"], [r.cells() for r in ratios]
    )
