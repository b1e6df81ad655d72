"""The benchmarks' pure helpers: table formatting, statistics, seeded workloads, the fake worker."""

from __future__ import annotations

import argparse
import math
import random

import pytest

from benchmarks.capacity import (
    EOS_TOKEN_ID,
    StopAtLengthWorker,
    make_workload,
    simulate,
)
from benchmarks.common import (
    SAFE_TOKEN_RANGE,
    format_table,
    mean,
    median,
    parse_int_list,
    parse_shapes,
    percentile,
    random_prompts,
    uniform_int,
)
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence

# ---- tables -----------------------------------------------------------------------------


def test_format_table_aligns_text_left_and_numbers_right() -> None:
    table = format_table(["name", "ms"], [["a", 1.234], ["longer", 123.44]])
    assert table.splitlines() == [
        "| name   |    ms |",
        "| ------ | ----: |",
        "| a      |  1.23 |",
        "| longer | 123.4 |",
    ]


def test_format_table_prints_nan_as_dash_and_ints_plainly() -> None:
    table = format_table(["n", "x"], [[3, math.nan]])
    assert table.splitlines()[-1] == "| 3 | - |"


def test_format_table_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match="columns"):
        format_table(["a", "b"], [[1]])


# ---- statistics ------------------------------------------------------------------------


def test_mean_and_median() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert math.isnan(mean([])) and math.isnan(median([]))


def test_percentile_interpolates_like_numpy() -> None:
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 90) == pytest.approx(37.0)  # numpy.percentile(values, 90)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile(values, 101)


# ---- parsing and workloads -------------------------------------------------------------


def test_parse_lists_and_shapes() -> None:
    assert parse_int_list("1, 8,32") == [1, 8, 32]
    assert parse_shapes("128x128,1024X16") == [(128, 128), (1024, 16)]
    for bad in ("", "0", "a"):
        with pytest.raises(ValueError):
            parse_int_list(bad)
    with pytest.raises(ValueError):
        parse_shapes("128")


def test_random_prompts_are_deterministic_and_in_range() -> None:
    prompts = random_prompts(4, 64, seed=3)
    assert prompts == random_prompts(4, 64, seed=3)
    assert prompts != random_prompts(4, 64, seed=4)
    assert [len(p) for p in prompts] == [64] * 4
    low, high = SAFE_TOKEN_RANGE
    assert all(low <= t < high for p in prompts for t in p)


def test_uniform_int_covers_both_ends() -> None:
    rng = random.Random(0)
    drawn = {uniform_int(rng, 3, 5) for _ in range(200)}
    assert drawn == {3, 4, 5}


def test_capacity_workload_is_deterministic_and_in_range() -> None:
    workload = make_workload(50, seed=1)
    assert workload == make_workload(50, seed=1)
    assert all(64 <= len(item.prompt_token_ids) <= 512 for item in workload)
    assert all(16 <= item.output_len <= 512 for item in workload)
    assert all(EOS_TOKEN_ID not in item.prompt_token_ids for item in workload)


# ---- the capacity simulation -----------------------------------------------------------


def test_fake_worker_emits_eos_at_the_drawn_length() -> None:
    worker = StopAtLengthWorker({"r": 3})
    sequence = NewSequence("r", [100] * 20, 20, [0, 1], 0, SamplingParams())
    first = worker.step(BatchPlan(0, new_sequences=[sequence], num_scheduled_tokens={"r": 16}))
    assert first.sampled_token_ids == {}  # a partial prefill chunk samples nothing
    sampled = [
        worker.step(BatchPlan(step, num_scheduled_tokens={"r": n})).sampled_token_ids["r"]
        for step, n in ((1, 4), (2, 1), (3, 1))
    ]
    assert sampled[-1] == EOS_TOKEN_ID and EOS_TOKEN_ID not in sampled[:-1]


def test_paged_fits_more_sequences_than_max_length() -> None:
    args = argparse.Namespace(
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        kv_budget_tokens=8192,
        max_new_tokens=512,
    )
    workload = make_workload(40, seed=0)
    paged = simulate(workload, "paged", args)
    max_length = simulate(workload, "max_length", args)
    assert paged.peak_running > max_length.peak_running
    assert paged.num_steps < max_length.num_steps
    assert max_length.num_preemptions == 0  # a reservation never has to grow


def test_verify_rows_break_even_acceptance() -> None:
    from benchmarks.verify_rows import break_even_acceptance

    # One draft must be accepted half the time to pay for a step 1.5x as long.
    assert break_even_acceptance(1, 0.5) == pytest.approx(0.5)
    # Three drafts: a + a^2 + a^3 = 0.14 at a ~ 0.124.
    a = break_even_acceptance(3, 0.14)
    assert a is not None and a + a**2 + a**3 == pytest.approx(0.14)
    assert break_even_acceptance(3, 3.5) is None  # more than every draft accepted yields
    assert break_even_acceptance(0, 0.1) is None
