"""`llmserve bench serve --compare-inprocess` for real: it starts an `llmserve up` stack on the
embedded model, runs a tiny load on it, stops it, runs the same load on the in-process engine
and prints both side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serve_compare import INPROCESS, compare_legend

pytestmark = pytest.mark.slow

# The first start of a worker may build the C++ kernels; later starts take seconds.
TIMEOUT_S = 900


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_compare_inprocess_fills_both_columns(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "services.cli", "bench", "serve", "--compare-inprocess"),
            *("--num-prompts", "2", "--concurrency", "1", "--input-len", "8"),
            *("--output-len", "4", "--warmup", "0"),
            # Eager steps start in seconds on both sides; a small KV cache keeps memory low.
            *("--enforce-eager", "--kv-cache-gib", "0.25", "--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = done.stdout
    assert "$ llmserve up " in report and "--enforce-eager" in report
    table = report[report.index("## in-process vs stack") :].splitlines()
    rows = [_cells(line) for line in table if line.startswith("| c=1 ")]
    assert [row[1:3] for row in rows] == [["inprocess", "2/2"], ["stack", "2/2"]]
    for row in rows:
        # Every figure and ratio measured on both systems; only "prompt cached %" may be
        # "-" (the in-process engine reports no cached tokens per request).
        assert "-" not in row[:-1]
    assert compare_legend(INPROCESS) in table
    compare = json.loads(out.read_text())["compare"]
    assert compare["run_order"] == ["stack", "inprocess"]
    assert compare["reference"] == "inprocess"
    assert [written["target"] for written in compare["rows"]] == ["inprocess", "stack"]
    for written in compare["rows"]:
        assert written["num_completed"] == 2
        assert written["tpot_p50_ms"] > 0 and written["ttft_p50_ms"] > 0
        assert written["output_tokens_per_s"] > 0
        assert all(value > 0 for value in written["over_reference"].values())
