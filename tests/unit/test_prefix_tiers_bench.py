"""`llmserve bench prefix-tiers`'s pure parts: the conversations, the pool sized to hold a few
of them, run summaries, and the ratios against the targets."""

from __future__ import annotations

import itertools
import math

import pytest

from benchmarks.prefix_tiers_workload import (
    GiB,
    RunSummary,
    conversations,
    cross_pair_turns,
    kv_bytes_per_token,
    pool_gib,
    ratios_table,
    resume_turns,
    runs_table,
    summarize,
    tier_ratios,
    turn_major,
)
from benchmarks.serve_metrics import Chunk, RequestRecord


def test_each_turn_extends_the_one_before() -> None:
    convs = conversations(3, 4, history_tokens=50, turn_tokens=7, seed=1)
    assert len(convs) == 3 and all(len(c) == 5 for c in convs)  # 4 turns + the resume turn
    for conv in convs:
        for before, after in itertools.pairwise(conv):
            assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
            assert len(after.prompt_token_ids) == len(before.prompt_token_ids) + 7
        assert len(conv[0].prompt_token_ids) == 57
    # Conversations share nothing (not even their first block), and a seed repeats them.
    assert convs[0][0].prompt_token_ids[:16] != convs[1][0].prompt_token_ids[:16]
    assert conversations(3, 4, 50, 7, seed=1) == convs
    # One conversation's ids do not depend on how many there are.
    assert conversations(1, 4, 50, 7, seed=1)[0] == convs[0]
    with pytest.raises(ValueError, match=">= 1"):
        conversations(0, 4, 50, 7)


def test_turns_go_turn_major_and_the_resume_turn_is_never_sent_before() -> None:
    convs = conversations(3, 2, 20, 4)
    order = [(t.conversation, t.turn) for t in turn_major(convs, 2)]
    assert order == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    resumed = resume_turns(convs)
    assert [(t.conversation, t.turn) for t in resumed] == [(0, 2), (1, 2), (2, 2)]


def test_the_pool_holds_the_asked_number_of_conversations() -> None:
    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.embedding_length": 576,
    }
    per_token = kv_bytes_per_token(metadata, 2)
    assert per_token == 2 * 30 * 3 * 64 * 2
    gib = pool_gib(per_token, conversation_tokens=2010, conversations_held=3, block_size=16)
    blocks = gib * GiB / (16 * per_token)
    assert blocks == pytest.approx(3 * 126)  # 2010 tokens round up to 126 blocks each


def record(prompt: int, cached: int, ttft_s: float, error: str | None = None) -> RequestRecord:
    r = RequestRecord(send_time_s=10.0, prompt_tokens=prompt, cached_prompt_tokens=cached)
    r.error = error
    if error is None:
        r.chunks.append(Chunk(time_s=10.0 + ttft_s, num_tokens=1))
    return r


def test_cross_pair_turns_send_each_conversations_first_two_back_to_back() -> None:
    convs = conversations(3, 4, 20, 5)
    turns = cross_pair_turns(convs)
    assert [(t.conversation, t.turn) for t in turns] == [(c, t) for c in range(3) for t in (0, 1)]
    assert turns[1].prompt_token_ids[: len(turns[0].prompt_token_ids)] == turns[0].prompt_token_ids


def test_a_summary_counts_only_completed_requests() -> None:
    run = summarize("tiers", [record(100, 80, 0.2), record(100, 100, 0.4), record(50, 0, 0, "x")])
    assert (run.requests, run.prompt_tokens, run.cached_prompt_tokens, run.errors) == (
        3,
        200,
        180,
        1,
    )
    assert run.hit_rate == pytest.approx(0.9)
    assert run.mean_ttft_ms == pytest.approx(300.0)
    assert math.isnan(summarize("none", []).hit_rate)


def test_ratios_against_the_targets() -> None:
    tiers = RunSummary("tiers", 10, 1000, 900, 100.0, 0)
    pool_only = RunSummary("pool only", 10, 1000, 100, 500.0, 0)
    restarted = RunSummary("restarted", 4, 400, 350, 60.0, 0)
    cold = RunSummary("cold start", 4, 400, 0, 400.0, 0)
    fetched = RunSummary("fetched", 4, 400, 360, 30.0, 0)
    recomputed = RunSummary("recomputed", 4, 400, 0, 200.0, 0)
    hit, ttft, cached, restart_ttft, pair_cached, pair_ttft = tier_ratios(
        tiers, pool_only, restarted, cold, fetched, recomputed
    )
    assert (hit.value, hit.met) == (0.9, True)
    assert (ttft.value, ttft.met) == (0.2, True)
    assert cached.value == pytest.approx(0.875) and cached.met is False
    assert (restart_ttft.value, restart_ttft.met) == (0.15, True)
    table = ratios_table([hit, ttft, cached, restart_ttft])
    assert "| 90.0% " in table and ">= 85%" in table and "0.20x" in table and "<= 0.3x" in table
    assert "87.5%" in table and "| no " in table
    assert (pair_cached.value, pair_cached.met) == (0.9, True)
    assert (pair_ttft.value, pair_ttft.met) == (0.15, True)
    assert "(c) cross-pair" in ratios_table([pair_cached, pair_ttft])
    # A run that failed every request has no ratio, and no verdict.
    failed = RunSummary("pool only", 10, 0, 0, math.nan, 10)
    nan_ttft = tier_ratios(tiers, failed, restarted, cold, fetched, recomputed)[1]
    assert math.isnan(nan_ttft.value) and nan_ttft.met is None
    assert "tiers" in runs_table([tiers, pool_only]) and "90.0" in runs_table([tiers])


@pytest.mark.parametrize(
    "flags", [["--conversations", "0"], ["--turns", "-1"], ["--pool-conversations", "0"]]
)
def test_bad_sizes_are_refused_naming_the_flag(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from benchmarks.prefix_tiers import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["prefix-tiers", *flags])
    assert flags[0] in capsys.readouterr().err
