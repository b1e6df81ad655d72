"""The llmserve vs llama.cpp comparison without running anything: the engines and workloads it
plans, the command lines it would run, the parsers of llama.cpp's tools (on output captured
from real runs, tests/unit/data/llamacpp/) and the table with its ratio columns."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.compare import (
    BatchedBenchRow,
    EngineSpec,
    PeersConfig,
    batched_bench_command,
    batched_bench_measures,
    engine_specs,
    llama_bench_command,
    llama_bench_measures,
    llama_server_command,
    offline_command,
    offline_measures,
    parse_batched_bench,
    parse_list,
    parse_llama_bench,
    serve_checks,
    serve_command,
    serve_measures,
    stack_flags,
)
from benchmarks.llamacpp_build import ninja_progress, requant_name
from benchmarks.peers_table import advantage, measures, peers_table

DATA = Path(__file__).parent / "data" / "llamacpp"
Q4_0 = Path("/cache/m.Q4_0.gguf")
Q4_1 = Path("/models/m.Q4_1.gguf")


def _engines(with_stack: bool = False) -> list[EngineSpec]:
    quantizations = ["none", "gguf"]
    stack = quantizations if with_stack else []
    return engine_specs(["Q4_0", "Q4_1"], quantizations, stack, {"Q4_0": Q4_0, "Q4_1": Q4_1}, Q4_1)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# ---- plan ------------------------------------------------------------------------------------


def test_default_shapes_are_the_published_workloads() -> None:
    config = PeersConfig()
    assert (config.input_len, config.output_len, config.threads) == (128, 128, 2)
    assert config.serve_prompts("a") == 8 and config.serve_concurrency("a") == 1
    assert config.serve_prompts("b") == 32 and config.serve_concurrency("b") == 16
    assert config.serve_warmup("a") == 2 and config.serve_warmup("b") == 16
    assert PeersConfig(warmup=0).serve_warmup("b") == 0
    # Every llama-server slot holds a whole request (256 tokens) with room to spare.
    assert config.server_ctx_per_slot >= 256 and config.server_ctx == 16 * 512
    assert config.batched_bench_ctx == 32 * 256


def test_engines_are_llamacpp_first_then_llmserve_then_the_stack() -> None:
    engines = _engines(with_stack=True)
    assert [e.name for e in engines] == [
        "llamacpp-q4_0",
        "llamacpp-q4_1",
        "llmserve-none",
        "llmserve-gguf",
        "llmserve-stack-none",
        "llmserve-stack-gguf",
    ]
    assert [e.title for e in engines][:3] == ["llama.cpp Q4_0", "llama.cpp Q4_1", "llmserve none"]
    assert engines[0].model == Q4_0 and all(e.model == Q4_1 for e in engines[1:])
    stack = engines[-1]
    assert [w for w in "abcd" if stack.runs(w)] == ["a", "b"]
    assert all(engines[2].runs(w) for w in "abcd")


def test_lists_reject_unknown_names_and_drop_repeats() -> None:
    assert parse_list("a, d,a", "abcd", "--workloads") == ["a", "d"]
    with pytest.raises(ValueError, match="--workloads"):
        parse_list("a,e", "abcd", "--workloads")
    with pytest.raises(ValueError):
        parse_list(" , ", "abcd", "--workloads")


# ---- command lines ---------------------------------------------------------------------------


def test_llama_server_has_a_slot_per_user_and_no_prompt_reuse() -> None:
    command = llama_server_command(Path("/bin/llama-server"), Q4_0, 8081, PeersConfig())
    assert command[0] == "/bin/llama-server"
    assert _flag(command, "--model") == str(Q4_0)
    assert _flag(command, "--port") == "8081" and _flag(command, "--host") == "127.0.0.1"
    assert _flag(command, "--threads") == _flag(command, "--threads-batch") == "2"
    assert _flag(command, "--parallel") == "16"
    assert int(_flag(command, "--ctx-size")) // 16 >= 256
    assert "--cont-batching" in command
    # Neither the slot's previous prompt nor the RAM prompt cache may serve a new request.
    assert "--no-cache-prompt" in command and _flag(command, "--cache-ram") == "0"


def test_llama_bench_measures_prompt_processing_only_as_json() -> None:
    command = llama_bench_command(Path("/bin/llama-bench"), Q4_1, PeersConfig(repeats=5))
    assert _flag(command, "-p") == "128,1024" and _flag(command, "-n") == "0"
    assert _flag(command, "--threads") == "2" and _flag(command, "--repetitions") == "5"
    assert _flag(command, "-o") == "json"


def test_batched_bench_runs_one_batch_of_separate_prompts() -> None:
    command = batched_bench_command(Path("/bin/llama-batched-bench"), Q4_1, PeersConfig())
    assert (_flag(command, "-npp"), _flag(command, "-ntg"), _flag(command, "-npl")) == (
        "128",
        "128",
        "32",
    )
    assert int(_flag(command, "--ctx-size")) >= 32 * 256  # else it skips the row silently
    assert "-pps" not in command  # each sequence prefills its own prompt, as ours do
    assert _flag(command, "--output-format") == "jsonl"
    assert _flag(command, "--threads") == _flag(command, "--threads-batch") == "2"


def test_both_sides_of_a_serving_run_get_the_same_requests(tmp_path: Path) -> None:
    config = PeersConfig(enforce_eager=True)
    llama, ours = _engines()[0], _engines()[2]
    out = tmp_path / "out.json"
    http = serve_command("py", llama, "http://127.0.0.1:1/v1", config, "b", out)
    inprocess = serve_command("py", ours, "inprocess", config, "b", out)
    assert http[:3] == ["py", "-m", "benchmarks.serve"]
    assert inprocess[: len(http)] == [*http[:4], "inprocess", *http[5:]]  # same requests
    assert _flag(http, "--dataset") == "synthetic"  # token ids, the same for both tokenizers
    assert _flag(http, "--concurrency") == "16" and _flag(http, "--num-prompts") == "32"
    assert "--quantization" not in http and "--model" not in http
    assert _flag(inprocess, "--quantization") == "none"
    assert _flag(inprocess, "--threads") == "2" and "--enforce-eager" in inprocess
    assert _flag(inprocess, "--max-num-seqs") == "16"  # as many as llama-server's slots
    single = serve_command("py", ours, "inprocess", config, "a", out)
    assert _flag(single, "--concurrency") == "1" and _flag(single, "--num-prompts") == "8"
    # A server kept up for a then b (llama-server, the stack) must see new prompts in b.
    assert _flag(single, "--seed") != _flag(inprocess, "--seed")


def test_offline_commands_run_the_batch_and_batch_one_prefills(tmp_path: Path) -> None:
    engine = _engines()[3]
    config = PeersConfig(repeats=2)
    batch = offline_command("py", engine, config, "c", tmp_path / "c.json")
    assert batch[:3] == ["py", "-m", "benchmarks.offline_table"]
    assert _flag(batch, "--batch-sizes") == "32" and _flag(batch, "--shapes") == "128x128"
    assert _flag(batch, "--quantization") == "gguf" and _flag(batch, "--repeats") == "2"
    prefill = offline_command("py", engine, config, "d", tmp_path / "d.json")
    assert _flag(prefill, "--batch-sizes") == "1"
    assert _flag(prefill, "--shapes") == "128x1,1024x1"


def test_a_no_drafts_column_runs_llmserve_with_speculation_off(tmp_path: Path) -> None:
    models = {"Q4_0": Q4_0}
    engines = engine_specs(["Q4_0"], ["gguf"], [], models, Q4_0, ["Q4_0"], (True, False))
    assert [e.name for e in engines] == [
        "llamacpp-q4_0",
        "llmserve-gguf",
        "llmserve-gguf-nospec",
    ]
    drafting, plain = engines[1], engines[2]
    assert plain.title.endswith("no drafts") and plain.model == drafting.model
    config = PeersConfig()
    for workload in ("a", "b"):
        command = serve_command("py", plain, "inprocess", config, workload, tmp_path / "o.json")
        assert "--no-speculation" in command
        default = serve_command("py", drafting, "inprocess", config, workload, tmp_path / "o.json")
        assert "--no-speculation" not in default
    for workload in ("c", "d"):
        assert "--no-speculation" in offline_command("py", plain, config, workload, tmp_path / "c")


def test_the_benchmarks_take_no_speculation_into_the_engine_config() -> None:
    import argparse

    from benchmarks import offline_table, serve
    from benchmarks.serve_targets import engine_config

    parser = argparse.ArgumentParser()
    serve.configure_parser(parser)
    off = engine_config(parser.parse_args(["--target", "inprocess", "--no-speculation"]))
    assert off.speculation is False
    assert engine_config(parser.parse_args(["--target", "inprocess"])).speculation is None
    offline = argparse.ArgumentParser()
    offline_table.configure_parser(offline)
    assert offline.parse_args(["--no-speculation"]).no_speculation is True


def test_stack_gets_the_engine_settings() -> None:
    flags = stack_flags(_engines(with_stack=True)[-1], PeersConfig(dtype="float32"))
    assert _flag(flags, "--quantization") == "gguf" and _flag(flags, "--dtype") == "float32"
    assert _flag(flags, "--worker-threads") == "2"
    assert "--enforce-eager" not in flags
    eager = stack_flags(_engines(with_stack=True)[-1], PeersConfig(enforce_eager=True))
    assert "--enforce-eager" in eager  # as the in-process column


# ---- parsers, on real output -----------------------------------------------------------------


def test_llama_bench_json_gives_prompt_speed_per_length() -> None:
    speeds = parse_llama_bench((DATA / "llama-bench.json").read_text())
    assert sorted(speeds) == [128, 1024]
    assert all(speed > 0 for speed in speeds.values())
    document = json.loads((DATA / "llama-bench.json").read_text())
    first = next(t for t in document if t["n_prompt"] == 128)
    assert speeds[128] == pytest.approx(statistics.median(first["samples_ts"]))


def test_llama_bench_parser_reads_jsonl_and_skips_logs_and_generation_tests() -> None:
    document = json.loads((DATA / "llama-bench.json").read_text())
    generation = {**document[0], "n_prompt": 0, "n_gen": 128, "samples_ts": [1.0]}
    lines = ["load_backend: loaded CPU backend", "[1/2] noise"]
    lines += [json.dumps(test) for test in [*document, generation]]
    speeds = parse_llama_bench("\n".join(lines))
    assert sorted(speeds) == [128, 1024]
    assert parse_llama_bench("no json here") == {}


def test_batched_bench_jsonl_and_markdown_give_the_same_row() -> None:
    from_jsonl = parse_batched_bench((DATA / "batched-bench.jsonl").read_text())
    from_md = parse_batched_bench((DATA / "batched-bench.md").read_text())
    assert len(from_jsonl) == 1 and len(from_md) == 1
    row = from_jsonl[0]
    assert (row.pp, row.tg, row.pl) == (from_md[0].pp, from_md[0].tg, from_md[0].pl)
    assert row.t_s == pytest.approx(row.t_pp_s + row.t_tg_s, rel=1e-3)
    assert row.extra["n_threads"] == 2
    # Its own S_TG column is the decode-only speed; ours counts the prefill time too.
    assert row.decode_tokens_per_s == pytest.approx(row.extra["speed_tg"], rel=1e-3)
    assert row.output_tokens_per_s < row.decode_tokens_per_s


def test_batched_bench_measures_use_the_whole_time() -> None:
    row = BatchedBenchRow(pp=128, tg=128, pl=32, t_pp_s=2.0, t_tg_s=6.0, t_s=8.0)
    values = batched_bench_measures([row], PeersConfig())
    assert values == {
        "c_output_tok_s": 32 * 128 / 8.0,
        "c_total_tok_s": 32 * 256 / 8.0,
        "c_decode_tok_s": 32 * 128 / 6.0,
    }
    assert batched_bench_measures([row], PeersConfig(offline_batch=16)) == {}
    assert llama_bench_measures({128: 900.0}, PeersConfig()) == {"d_prefill_128_tok_s": 900.0}


# ---- our own benchmarks' JSON ----------------------------------------------------------------


def _serve_document(requests: list[dict[str, object]]) -> dict[str, object]:
    summary = {
        "ttft": {"p50_ms": 40.0},
        "tpot": {"p50_ms": 12.5},
        "output_tokens_per_s": 300.0,
    }
    return {"points": [{"summary": summary, "requests": requests}]}


def _request(**overrides: object) -> dict[str, object]:
    return {
        "error": None,
        "prompt_tokens": 128,
        "output_tokens": 128,
        "cached_prompt_tokens": 0,
        **overrides,
    }


def test_serve_measures_pick_the_workloads_numbers() -> None:
    document = _serve_document([_request()])
    assert serve_measures(document, "a") == {"a_tpot_ms": 12.5, "a_ttft_ms": 40.0}
    assert serve_measures(document, "b") == {"b_output_tok_s": 300.0, "b_ttft_ms": 40.0}
    assert serve_checks(document, PeersConfig()) == []


def test_serve_checks_flag_short_outputs_cache_hits_and_failures() -> None:
    document = _serve_document(
        [
            _request(output_tokens=97),
            _request(cached_prompt_tokens=64),
            _request(error="HTTP 503"),
            _request(prompt_tokens=129),
        ]
    )
    problems = serve_checks(document, PeersConfig())
    assert len(problems) == 4
    assert "1 of 4 requests failed: HTTP 503" in problems[0]
    assert "[97] output tokens" in problems[1]
    assert "[129] tokens" in problems[2]
    assert "64 prompt tokens were served from a cache" in problems[3]


def test_offline_measures_turn_prefill_time_into_tokens_per_second() -> None:
    def cell(batch: int, input_len: int, output_len: int, **median: float) -> dict[str, object]:
        return {
            "batch_size": batch,
            "input_len": input_len,
            "output_len": output_len,
            "median": median,
        }

    document = {
        "cells": [
            cell(
                32,
                128,
                128,
                output_tokens_per_s=250.0,
                total_tokens_per_s=500.0,
                decode_ms_per_step=100.0,
            ),
            cell(1, 128, 1, prefill_ms=100.0),
            cell(1, 1024, 1, prefill_ms=512.0),
        ]
    }
    config = PeersConfig()
    assert offline_measures(document, config, "c") == {
        "c_output_tok_s": 250.0,
        "c_total_tok_s": 500.0,
        "c_decode_tok_s": 320.0,  # 32 sequences per 100 ms step
    }
    assert offline_measures(document, config, "d") == {
        "d_prefill_128_tok_s": 1280.0,
        "d_prefill_1024_tok_s": 2000.0,
    }


# ---- the table -------------------------------------------------------------------------------


def test_advantage_is_above_one_when_llmserve_is_ahead_either_way() -> None:
    assert advantage(200.0, 100.0, higher_is_better=True) == 2.0
    assert advantage(10.0, 20.0, higher_is_better=False) == 2.0
    assert advantage(20.0, 10.0, higher_is_better=False) == 0.5
    assert math.isnan(advantage(math.nan, 10.0, higher_is_better=True))
    assert math.isnan(advantage(0.0, 10.0, higher_is_better=False))


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_table_has_a_row_per_measure_and_ratios_of_the_best_llmserve() -> None:
    engines = _engines()
    config = PeersConfig()
    values = {
        "llamacpp-q4_0": {"a_tpot_ms": 10.0, "b_output_tok_s": 400.0},
        "llamacpp-q4_1": {"a_tpot_ms": 12.0, "b_output_tok_s": 300.0},
        "llmserve-none": {"a_tpot_ms": 20.0, "b_output_tok_s": 600.0},
        "llmserve-gguf": {"a_tpot_ms": 8.0, "b_output_tok_s": math.nan},
    }
    lines = peers_table(measures(config, ["a", "b"]), engines, values).splitlines()
    header = _cells(lines[0])
    assert header[:6] == [
        "measure",
        "better",
        "llama.cpp Q4_0",
        "llama.cpp Q4_1",
        "llmserve none",
        "llmserve gguf",
    ]
    assert header[6] == "best llmserve"
    assert header[7:] == ["best vs llama.cpp Q4_0 (x)", "best vs llama.cpp Q4_1 (x)"]
    rows = {cells[0]: cells[1:] for cells in map(_cells, lines[2:])}
    assert len(rows) == 4  # a: TPOT, TTFT; b: tok/s, TTFT
    tpot = rows["a. 1 user 128/128: TPOT p50 ms"]
    assert tpot == ["lower", "10.0", "12.0", "20.0", "8.00", "llmserve gguf", "1.25", "1.50"]
    throughput = rows["b. 16 users x 2 128/128: output tok/s"]
    assert throughput[4:] == ["-", "llmserve none", "1.50", "2.00"]
    ttft = rows["a. 1 user 128/128: TTFT p50 ms"]
    assert ttft[1:] == ["-", "-", "-", "-", "-", "-", "-"]  # nothing measured


def test_table_without_llamacpp_has_no_ratio_columns() -> None:
    engines = _engines()[2:]
    table = peers_table(measures(PeersConfig(), ["d"]), engines, {})
    header = _cells(table.splitlines()[0])
    assert header == ["measure", "better", "llmserve none", "llmserve gguf"]
    assert len(table.splitlines()) == 2 + 2  # prefill at 128 and at 1024


# ---- the build -------------------------------------------------------------------------------


def test_build_progress_and_requant_names() -> None:
    assert ninja_progress("[12/218] Building CXX object src/llama.cpp.o") == (12, 218)
    assert ninja_progress("FAILED: src/llama.cpp.o") is None
    assert requant_name(Path("x/SmolLM2-135M-Instruct.Q4_1.gguf"), "Q4_0") == (
        "SmolLM2-135M-Instruct.Q4_0.gguf"
    )
    assert requant_name(Path("model.gguf"), "Q4_0") == "model.Q4_0.gguf"


def test_llmserve_on_each_file_is_compared_with_llamacpp_on_that_file() -> None:
    models = {"Q4_0": Q4_0, "Q4_1": Q4_1}
    engines = engine_specs(["Q4_0", "Q4_1"], ["gguf"], [], models, Q4_1, ["Q4_1", "Q4_0"])
    assert [e.name for e in engines] == [
        "llamacpp-q4_0",
        "llamacpp-q4_1",
        "llmserve-gguf-q4_1",
        "llmserve-gguf-q4_0",
    ]
    assert [e.model for e in engines] == [Q4_0, Q4_1, Q4_1, Q4_0]
    assert engines[3].title == "llmserve gguf Q4_0"
    values = {
        "llamacpp-q4_0": {"a_tpot_ms": 10.0},
        "llamacpp-q4_1": {"a_tpot_ms": 12.0},
        "llmserve-gguf-q4_1": {"a_tpot_ms": 6.0},  # the best column overall
        "llmserve-gguf-q4_0": {"a_tpot_ms": 8.0},
    }
    lines = peers_table(measures(PeersConfig(), ["a"]), engines, values).splitlines()
    tpot = {cells[0]: cells[1:] for cells in map(_cells, lines[2:])}[
        "a. 1 user 128/128: TPOT p50 ms"
    ]
    # Q4_0 against llmserve on Q4_0 (10 / 8), Q4_1 against llmserve on Q4_1 (12 / 6).
    assert tpot[-3:] == ["llmserve gguf Q4_1", "1.25", "2.00"]
