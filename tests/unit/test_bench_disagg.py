"""`llmserve bench disagg`'s pure parts: the document schedule, the prompts, the per-run
figures, the table and the target ratios."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import disagg
from benchmarks.common import SAFE_TOKEN_RANGE, format_table
from benchmarks.disagg_report import (
    HEADERS,
    RunResult,
    Transfer,
    best_colocated,
    document_times,
    prompt_ids,
    ratio_rows,
    result_row,
    target_ratios,
)


def run_result(
    name: str = "run",
    tpot_ms: tuple[float, ...] = (10.0, 20.0, 30.0),
    tokens: int = 300,
    wall_s: float = 10.0,
    ttft_ms: tuple[float, ...] = (1000.0,),
    transfer: Transfer | None = None,
) -> RunResult:
    return RunResult(
        name,
        [t / 1e3 for t in tpot_ms],
        tokens,
        wall_s,
        [t / 1e3 for t in ttft_ms],
        transfer,
    )


def test_document_schedule_is_periodic_from_half_a_period_and_stops_before_the_end() -> None:
    assert document_times(10.0, 4.0) == [2.0, 6.0]
    assert document_times(10.0, 2.0) == [1.0, 3.0, 5.0, 7.0, 9.0]
    assert document_times(1.0, 5.0) == []


def test_document_schedule_refuses_a_period_of_zero() -> None:
    with pytest.raises(ValueError, match="--documents-every-s"):
        document_times(10.0, 0.0)


def test_prompts_are_distinct_from_their_first_token_and_stay_in_the_safe_range() -> None:
    prompts = [prompt_ids(stream, index, 64) for stream in range(9) for index in range(20)]
    assert all(len(p) == 64 for p in prompts)
    assert len({p[0] for p in prompts}) == len(prompts)
    low, high = SAFE_TOKEN_RANGE
    assert all(low <= token < high for p in prompts for token in p)
    assert prompt_ids(3, 4, 16) == prompt_ids(3, 4, 16)


def test_run_figures_are_percentiles_in_ms_and_tokens_over_wall_time() -> None:
    result = run_result(tpot_ms=(10.0, 20.0, 30.0), tokens=300, wall_s=10.0, ttft_ms=(100, 300))
    assert result.chat_tpot_p50_ms == pytest.approx(20.0)
    assert result.chat_tpot_p99_ms == pytest.approx(29.8)
    assert result.chat_tok_s == pytest.approx(30.0)
    assert result.document_ttft_p50_ms == pytest.approx(200.0)


def test_transfer_share_is_seconds_per_document_over_document_ttft() -> None:
    transfer = Transfer(num_bytes=8 * 2**20, seconds=0.2, count=4)
    result = run_result(ttft_ms=(1000.0,), transfer=transfer)
    assert result.transfer_s_per_document == pytest.approx(0.05)
    assert result.transfer_share == pytest.approx(0.05)
    row = result_row(result)
    assert row[6] == pytest.approx(8.0)  # MiB
    assert row[8] == pytest.approx(50.0)  # ms per document
    assert row[9] == "5.0%"


def test_transfer_difference_and_no_transfer_gives_nan() -> None:
    assert Transfer(10, 2, 3) - Transfer(4, 0.5, 1) == Transfer(6, 1.5, 2)
    chat_only = run_result(ttft_ms=(), transfer=Transfer(0, 0, 0))
    assert math.isnan(chat_only.transfer_share)
    assert result_row(chat_only)[9] == "-"


def test_colocated_rows_show_dashes_for_transfer_and_the_table_renders() -> None:
    row = result_row(run_result(name="colocated, chunk 512"))
    assert row[6:] == ["-", "-", "-", "-"]
    table = format_table(HEADERS, [row])
    assert "colocated, chunk 512" in table and "chat TPOT p99 ms" in table


def test_best_colocated_is_the_lowest_chat_tpot_p99() -> None:
    runs = [
        run_result("128", tpot_ms=(50.0,)),
        run_result("512", tpot_ms=(20.0,)),
        run_result("1024", tpot_ms=(40.0,)),
    ]
    assert best_colocated(runs).name == "512"
    with pytest.raises(ValueError):
        best_colocated([])


def test_target_ratios_compare_against_the_targets() -> None:
    colocated = run_result(tpot_ms=(100.0,))
    disaggregated = run_result(
        tpot_ms=(40.0,), ttft_ms=(1000.0,), transfer=Transfer(1, seconds=0.1, count=1)
    )
    chat_colocated = run_result(tokens=1000, wall_s=10.0)
    chat_disaggregated = run_result(tokens=850, wall_s=10.0)
    ratios = target_ratios(colocated, disaggregated, chat_colocated, chat_disaggregated)
    assert [r.value for r in ratios] == pytest.approx([0.4, 0.1, 0.85])
    assert [r.met for r in ratios] == [True, False, False]
    rows = ratio_rows(ratios)
    assert [row[1] for row in rows] == ["0.400", "0.100", "0.850"]
    assert [row[2] for row in rows] == ["<= 0.5", "<= 0.05", ">= 0.9"]
    assert [row[3] for row in rows] == ["yes", "no", "no"]


def test_flags_split_the_threads_and_refuse_bad_values() -> None:
    parser = argparse.ArgumentParser()
    disagg.configure_parser(parser)
    args = parser.parse_args(["--chunk-sizes", "256,512", "--model", "m.gguf"])
    assert args.chunk_sizes == [256, 512]
    colocated = disagg.colocated_flags(args, 256)
    assert colocated[colocated.index("--worker-threads") + 1] == "2"
    assert colocated[colocated.index("--max-num-batched-tokens") + 1] == "256"
    split = disagg.disaggregated_flags(args, 512)
    assert split[split.index("--worker-threads") + 1] == "1"
    assert "--prefill-pairs" in split and "--decode-pairs" in split
    assert split[split.index("--model") + 1] == "m.gguf"
    for bad in (["--chunk-sizes", "0,128"], ["--documents-every-s", "0"], ["--chat-users", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
