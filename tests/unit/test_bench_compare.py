"""The llmserve vs llama.cpp comparison without running either server: the commands it would
run and the side-by-side table it prints."""

from __future__ import annotations

import math
from pathlib import Path

from services.bench.compare import (
    CompareConfig,
    bench_command,
    comparison_table,
    llamacpp_server,
    llmserve_server,
)


def _config(tmp_path: Path) -> CompareConfig:
    return CompareConfig(
        model=Path("/models/m.gguf"),
        concurrencies=(1, 8, 32, 64),
        input_len=128,
        output_len=128,
        min_prompts=8,
        prompts_per_concurrency=2,
        warmup=2,
        threads=2,
        seed=0,
        out_dir=tmp_path,
        llamacpp_python="/venv/bin/python",
        llamacpp_ctx=2048,
        llmserve_dtype="auto",
    )


def test_prompts_per_run_are_a_few_waves_and_at_least_the_minimum(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert [config.num_prompts(c) for c in config.concurrencies] == [8, 16, 64, 128]


def test_both_servers_get_the_same_model_and_threads(tmp_path: Path) -> None:
    config = _config(tmp_path)
    llama = llamacpp_server(config).command
    ours = llmserve_server(config).command
    assert llama[:3] == ["/venv/bin/python", "-m", "llama_cpp.server"]
    for flags, model_flag, threads_flag in (
        (llama, "--model", "--n_threads"),
        (ours, "--model", "--worker-threads"),
    ):
        assert flags[flags.index(model_flag) + 1] == "/models/m.gguf"
        assert flags[flags.index(threads_flag) + 1] == "2"
    # Without this, a queued request makes llama-cpp-python cut the streaming one short.
    assert llama[llama.index("--interrupt_requests") + 1] == "False"
    assert ours[ours.index("--max-num-seqs") + 1] == "64"


def test_bench_runs_send_the_same_text_prompts_to_both(tmp_path: Path) -> None:
    config = _config(tmp_path)
    commands = [
        bench_command(server, config, 32, tmp_path / "out.json")
        for server in (llmserve_server(config), llamacpp_server(config))
    ]
    targets = [command[command.index("--target") + 1] for command in commands]
    assert targets[0].startswith("grpc://") and targets[1].startswith("http://")
    strip = {"--target", *targets}
    assert [a for a in commands[0] if a not in strip] == [a for a in commands[1] if a not in strip]
    command = commands[0]
    assert command[command.index("--dataset") + 1] == "synthetic-text"
    assert command[command.index("--num-prompts") + 1] == "64"


def _summary(tok_s: float, ttft_p50: float) -> dict[str, object]:
    return {
        "num_completed": 8,
        "output_tokens_per_s": tok_s,
        "ttft": {"p50_ms": ttft_p50, "p99_ms": 2 * ttft_p50},
        "tpot": {"p50_ms": 10.0},
        "e2e": {"p50_ms": 1000.0},
    }


def test_table_puts_the_engines_side_by_side_and_marks_missing_runs() -> None:
    results = {
        "llmserve": {1: {"summary": _summary(100.0, 20.0)}, 8: {"summary": None}},
        "llamacpp": {1: {"summary": _summary(150.0, 30.0)}, 8: {"summary": _summary(1, 2)}},
    }
    table = comparison_table(results, [1, 8]).splitlines()
    headers = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert headers[:4] == [
        "concurrency",
        "requests ok",
        "output tok/s llmserve",
        "output tok/s llama.cpp",
    ]
    first = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert first[:6] == ["1", "8/8", "100.0", "150.0", "20.0", "30.0"]
    second = [cell.strip() for cell in table[3].strip("|").split("|")]
    assert second[1] == "0/8" and second[2] == "-"  # the failed llmserve run
    assert not math.isnan(float(second[3]))
