"""`--dtype auto` for dense models on a CPU: the faster of float32 and bf16 on this machine,
measured once and then read from the cache file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from services.worker import dtype_choice
from services.worker.config import resolve_dtype


def timings(float32: float, bfloat16: float) -> dtype_choice.Timings:
    rows = [str(r) for r in dtype_choice.ROW_COUNTS]
    return {
        "float32": dict.fromkeys(rows, float32 / len(rows)),
        "bfloat16": dict.fromkeys(rows, bfloat16 / len(rows)),
    }


def test_the_least_total_time_wins_and_a_tie_keeps_float32() -> None:
    assert dtype_choice.faster_of(timings(3.0, 2.0)) is torch.bfloat16
    assert dtype_choice.faster_of(timings(2.0, 3.0)) is torch.float32
    assert dtype_choice.faster_of(timings(2.0, 2.0)) is torch.float32
    # Fast at one row but slow in prefill (bf16 without native support): float32.
    mixed = timings(0.0, 0.0)
    mixed["float32"] |= {"1": 2.5, "16": 9.0, "128": 29.0}
    mixed["bfloat16"] |= {"1": 1.4, "16": 17.0, "128": 141.0}
    assert dtype_choice.faster_of(mixed) is torch.float32


def test_measures_once_then_reads_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "dtype.json"
    monkeypatch.setenv(dtype_choice.CACHE_ENV_VAR, str(path))
    calls: list[int] = []

    def fake_measure() -> dtype_choice.Timings:
        calls.append(1)
        return timings(3.0, 1.0)

    monkeypatch.setattr(dtype_choice, "measure", fake_measure)
    assert dtype_choice.measured_cpu_dtype() is torch.bfloat16
    assert dtype_choice.measured_cpu_dtype() is torch.bfloat16
    assert len(calls) == 1
    stored = json.loads(path.read_text())
    assert stored[dtype_choice.machine_key()] == timings(3.0, 1.0)
    # A damaged or outdated entry is measured again, other machines' entries kept.
    stored[dtype_choice.machine_key()] = {"float32": 1.0}
    stored["another machine"] = timings(1.0, 2.0)
    path.write_text(json.dumps(stored))
    assert dtype_choice.measured_cpu_dtype() is torch.bfloat16
    assert len(calls) == 2
    assert json.loads(path.read_text())["another machine"] == timings(1.0, 2.0)
    path.write_text("not json")
    assert dtype_choice.measured_cpu_dtype() is torch.bfloat16
    assert len(calls) == 3


def test_an_unwritable_cache_still_chooses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(dtype_choice.CACHE_ENV_VAR, str(blocker / "dtype.json"))
    monkeypatch.setattr(dtype_choice, "measure", lambda: timings(1.0, 2.0))
    assert dtype_choice.measured_cpu_dtype() is torch.float32


def test_auto_measures_only_dense_cpu_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_choice, "measured_cpu_dtype", lambda: torch.bfloat16)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    assert resolve_dtype("auto", "cpu", gguf_blocks=True) is torch.float32
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("float32", "cpu") is torch.float32


def test_a_real_product_is_timed() -> None:
    seconds = dtype_choice.time_product(torch.float32, rows=1, repeats=1)
    assert math.isfinite(seconds) and seconds > 0
