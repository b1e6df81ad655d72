"""`llmserve bench spec`'s workloads: seeded, varied per request, JSON extraction under its
schema, a code edit naming an identifier of its file; bad names and modes are refused."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import spec
from benchmarks.serve_metrics import Chunk, RequestRecord
from benchmarks.spec_workload import WORKLOADS, workload_requests
from services.engine.config import EngineConfig


@pytest.mark.parametrize("workload", WORKLOADS)
def test_requests_are_seeded_and_varied(workload: str) -> None:
    first = workload_requests(workload, 4, seed=1)
    assert first == workload_requests(workload, 4, seed=1)
    assert first != workload_requests(workload, 4, seed=2)
    assert len(first) == 4
    assert all((r.structured_output is not None) == (workload == "json") for r in first)


def test_a_code_edit_renames_an_identifier_of_its_file() -> None:
    request = workload_requests("code_edit", 1, seed=3)[0]
    text = request.messages[-1].content
    old = text.split("`")[1]
    assert f"({old}" in text or f" {old}" in text.split("```python")[1]


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="workload"):
        workload_requests("poems", 1, seed=0)
    args = argparse.Namespace(workloads="chat", modes="off,eagle", users="1")
    with pytest.raises(SystemExit, match="--modes"):
        spec.run(args)


def test_modes_are_the_baseline_the_defaults_and_each_proposer() -> None:
    args = argparse.Namespace(kv_cache_gib=0.5, num_speculative_tokens=5, suffix_cache_tokens=4096)
    off = spec.engine_config("off", args)
    assert off.speculation is False and off.suffix_cache_tokens == 0
    default = spec.engine_config("default", args)
    plain = EngineConfig()
    assert default.speculation is None and default.speculative_ngram == plain.speculative_ngram > 0
    assert default.suffix_cache_tokens == plain.speculative_suffix_cache_tokens > 0
    ngram = spec.engine_config("ngram", args)
    assert ngram.speculation and (ngram.speculative_ngram, ngram.suffix_cache_tokens) == (5, 0)
    suffix = spec.engine_config("suffix", args)
    assert (suffix.speculative_ngram, suffix.suffix_cache_tokens) == (5, 4096)


def test_decode_time_per_token_leaves_out_the_first_token_and_one_token_answers() -> None:
    def record(first_s: float, last_s: float, tokens: int) -> RequestRecord:
        chunks = [Chunk(first_s, 1)] + ([Chunk(last_s, tokens - 1)] if tokens > 1 else [])
        return RequestRecord(
            send_time_s=0.0, end_time_s=last_s, chunks=chunks, output_tokens=tokens
        )

    records = [
        record(1.0, 1.3, 4),  # 100 ms/token
        record(2.0, 2.5, 2),  # 500 ms/token
        record(3.0, 3.0, 1),  # no decode
    ]
    assert spec.decode_ms_per_token(records) == pytest.approx(300.0)
    assert spec.decode_ms_per_token(records[2:]) == 0.0


def test_the_table_gives_both_speed_ups_over_off() -> None:
    def cell(tok_s: float, decode_ms: float) -> spec.Cell:
        return spec.Cell([spec.Round(tok_s, 1000 / tok_s, decode_ms, 2.0, 0.5)])

    cells = {
        ("code_edit", 1, "off"): cell(100.0, 10.0),
        ("code_edit", 1, "default"): cell(150.0, 4.0),
    }
    rows = {row[2]: dict(zip(spec.HEADERS, row, strict=True)) for row in spec.table_rows(cells)}
    assert rows["default"]["speed-up"] == "1.50x"
    assert rows["default"]["decode speed-up"] == "2.50x"
    assert rows["default"]["decode ms/token"] == 4.0
    assert rows["off"]["decode speed-up"] == "1.00x"
