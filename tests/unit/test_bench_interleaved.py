"""The interleaved benchmark's pure parts: --stack parsing, a round's figures, the table."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks.interleaved import (
    HEADERS,
    INPROCESS,
    RoundResult,
    interleaved_rows,
    parse_stack,
    prompts_for_round,
    round_result,
)
from services.cli import build_parser


def test_parse_stack() -> None:
    assert parse_stack('nice=--cpu-placement nice --scheduling "serial"') == (
        "nice",
        ["--cpu-placement", "nice", "--scheduling", "serial"],
    )
    assert parse_stack("plain=") == ("plain", [])
    for bad in ("no-equals", "=--x", f"{INPROCESS}=--x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_stack(bad)


def test_the_cli_takes_repeated_stacks() -> None:
    args = build_parser().parse_args(
        ["bench", "interleaved", "--rounds", "2", "--stack", "a=--x 1", "--stack", "b="]
    )
    assert args.rounds == 2 and args.stack == [("a", ["--x", "1"]), ("b", [])]


def test_round_result() -> None:
    # Two streams from t=0: 5 tokens 10 ms apart, 3 tokens 20 ms apart; the round ends at 0.05 s.
    first = [0.01 + 0.01 * i for i in range(5)]
    second = [0.01 + 0.02 * i for i in range(3)]
    result = round_result([first, second], started=0.0)
    assert result.tpot_p50_ms == pytest.approx(15.0)
    assert result.output_tok_s == pytest.approx(8 / 0.05)
    assert math.isnan(round_result([[0.5]], started=0.0).tpot_p50_ms)
    with pytest.raises(ValueError, match="no request"):
        round_result([[], []], started=0.0)


def test_rows_are_medians_with_ratios_to_in_process() -> None:
    results = {
        INPROCESS: [RoundResult(10.0, 100.0), RoundResult(12.0, 80.0), RoundResult(11.0, 90.0)],
        "stack": [RoundResult(11.0, 90.0), RoundResult(13.2, 72.0), RoundResult(12.1, 81.0)],
    }
    rows = interleaved_rows(results)
    assert len(rows[0]) == len(HEADERS)
    assert rows[0] == [INPROCESS, 11.0, 1.0, 90.0, 1.0]
    name, tpot, tpot_ratio, tok_s, tok_s_ratio = rows[1]
    assert name == "stack" and tpot == pytest.approx(12.1) and tok_s == pytest.approx(81.0)
    assert tpot_ratio == pytest.approx(1.1) and tok_s_ratio == pytest.approx(0.9)


def test_prompts_differ_across_requests_and_rounds() -> None:
    first, second = prompts_for_round(0, 2, 64, 49152), prompts_for_round(1, 2, 64, 49152)
    assert all(len(p) == 64 for p in first + second)
    assert len({tuple(p[:16]) for p in first + second}) == 4  # no shared first block
    assert all(1000 <= t < 49152 for p in first for t in p)
