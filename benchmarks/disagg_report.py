"""`llmserve bench disagg`'s pure parts: the workload's schedule and prompts, one run's figures
from what the clients saw and the workers' transfer metrics, the table and the target ratios.
No clock, no network: benchmarks/disagg.py records times and scrapes, this module does the
arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.common import SAFE_TOKEN_RANGE, percentile

PROMPT_TOKEN_ID_FLOOR, _TOKEN_ID_END = SAFE_TOKEN_RANGE
PROMPT_TOKEN_ID_SPAN = _TOKEN_ID_END - PROMPT_TOKEN_ID_FLOOR

TARGET_TPOT_P99_RATIO = 0.5
TARGET_TRANSFER_SHARE = 0.05
TARGET_CHAT_ONLY_RATIO = 0.9


def document_times(duration_s: float, every_s: float) -> list[float]:
    """When documents are sent, seconds from the run's start: one every `every_s`, the first
    after half a period (chat users are streaming by then), none at or after `duration_s`."""
    if every_s <= 0:
        raise ValueError(f"--documents-every-s must be > 0, got {every_s}")
    times: list[float] = []
    at = every_s / 2
    while at < duration_s:
        times.append(at)
        at += every_s
    return times


def prompt_ids(stream: int, index: int, num_tokens: int) -> list[int]:
    """A distinct token-id prompt per (stream, index): no two requests share a prefix, so no
    prefix-cache hit flatters a configuration."""
    base = (stream * 1_000_003 + index * 7919) % PROMPT_TOKEN_ID_SPAN
    return [
        PROMPT_TOKEN_ID_FLOOR + (base + position * 31 + stream) % PROMPT_TOKEN_ID_SPAN
        for position in range(num_tokens)
    ]


@dataclass(frozen=True, slots=True)
class Transfer:
    """The prefill workers' `sent` KV transfer metrics over one run (differences of counters)."""

    num_bytes: float
    seconds: float
    count: float

    def __sub__(self, earlier: Transfer) -> Transfer:
        return Transfer(
            self.num_bytes - earlier.num_bytes,
            self.seconds - earlier.seconds,
            self.count - earlier.count,
        )


NO_TRANSFER = Transfer(0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One configuration's run: per-request figures as the clients measured them."""

    name: str
    chat_tpot_s: Sequence[float]
    chat_output_tokens: int
    wall_s: float
    document_ttft_s: Sequence[float]
    transfer: Transfer | None = None
    """Only for a disaggregated stack."""

    @property
    def chat_tpot_p50_ms(self) -> float:
        return percentile(self.chat_tpot_s, 50) * 1e3

    @property
    def chat_tpot_p99_ms(self) -> float:
        return percentile(self.chat_tpot_s, 99) * 1e3

    @property
    def chat_tok_s(self) -> float:
        return self.chat_output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def document_ttft_p50_ms(self) -> float:
        return percentile(self.document_ttft_s, 50) * 1e3

    @property
    def document_ttft_p99_ms(self) -> float:
        return percentile(self.document_ttft_s, 99) * 1e3

    @property
    def transfer_s_per_document(self) -> float:
        if self.transfer is None or self.transfer.count <= 0:
            return math.nan
        return self.transfer.seconds / self.transfer.count

    @property
    def transfer_share(self) -> float:
        """A document's transfer time over its prefill time, whose measure here is its TTFT
        (p50): the prefill, the transfer and the hand-over to the decode pair."""
        ttft_s = percentile(self.document_ttft_s, 50)
        if not ttft_s or math.isnan(ttft_s):
            return math.nan
        return self.transfer_s_per_document / ttft_s


HEADERS = [
    "configuration",
    "chat TPOT p50 ms",
    "chat TPOT p99 ms",
    "chat tok/s",
    "doc TTFT p50 ms",
    "doc TTFT p99 ms",
    "transfer MiB",
    "transfer s (sum)",
    "transfer ms / doc",
    "transfer / prefill",
]


def result_row(result: RunResult) -> list[object]:
    transfer = result.transfer
    share = result.transfer_share
    return [
        result.name,
        result.chat_tpot_p50_ms,
        result.chat_tpot_p99_ms,
        result.chat_tok_s,
        result.document_ttft_p50_ms,
        result.document_ttft_p99_ms,
        "-" if transfer is None else transfer.num_bytes / 2**20,
        "-" if transfer is None else transfer.seconds,
        "-" if transfer is None else result.transfer_s_per_document * 1e3,
        "-" if transfer is None or math.isnan(share) else f"{share:.1%}",
    ]


def best_colocated(results: Sequence[RunResult]) -> RunResult:
    """The colocated chunk size kept: the lowest chat TPOT p99 (what disaggregation is for)."""
    if not results:
        raise ValueError("no colocated run")
    return min(results, key=lambda r: (math.isnan(r.chat_tpot_p99_ms), r.chat_tpot_p99_ms))


@dataclass(frozen=True, slots=True)
class Ratio:
    name: str
    value: float
    target: str
    met: bool


def target_ratios(
    colocated: RunResult,
    disaggregated: RunResult,
    chat_only_colocated: RunResult | None,
    chat_only_disaggregated: RunResult | None,
) -> list[Ratio]:
    """The three figures the feature's targets name, each with whether it meets its target."""
    tpot = disaggregated.chat_tpot_p99_ms / colocated.chat_tpot_p99_ms
    share = disaggregated.transfer_share
    ratios = [
        Ratio(
            "chat TPOT p99 disaggregated / colocated best",
            tpot,
            f"<= {TARGET_TPOT_P99_RATIO:g}",
            tpot <= TARGET_TPOT_P99_RATIO,
        ),
        Ratio(
            "KV transfer / document prefill time",
            share,
            f"<= {TARGET_TRANSFER_SHARE:g}",
            share <= TARGET_TRANSFER_SHARE,
        ),
    ]
    if chat_only_colocated is not None and chat_only_disaggregated is not None:
        chat_only = chat_only_disaggregated.chat_tok_s / chat_only_colocated.chat_tok_s
        ratios.append(
            Ratio(
                "chat-only tok/s disaggregated / colocated",
                chat_only,
                f">= {TARGET_CHAT_ONLY_RATIO:g}",
                chat_only >= TARGET_CHAT_ONLY_RATIO,
            )
        )
    return ratios


RATIO_HEADERS = ["ratio", "value", "target", "met"]


def ratio_rows(ratios: Sequence[Ratio]) -> list[list[object]]:
    # Three decimals: a TPOT ratio of 0.02 and one of 0.024 are different findings.
    return [[r.name, f"{r.value:.3f}", r.target, "yes" if r.met else "no"] for r in ratios]
