"""The worker's memory budget: the refusal at start when weights + KV cache + runtime do not
fit (named numbers, before any weight is read), the estimate a start makes, and the report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.model_source import embedded_model_path
from services.contracts.memory_budget import GiB, MemoryBudget, MiB
from services.worker.memory_budget import (
    InsufficientMemoryError,
    available_bytes,
    check_fits,
    estimated_weight_bytes,
    machine_bytes,
)


def test_a_budget_that_fits_passes_and_one_that_does_not_names_every_number() -> None:
    check_fits(weight_bytes=GiB, kv_cache_bytes=GiB, runtime_bytes=GiB, available=3 * GiB)
    with pytest.raises(InsufficientMemoryError) as refused:
        check_fits(
            weight_bytes=5 * GiB,
            kv_cache_bytes=20 * GiB,
            runtime_bytes=400 * MiB,
            available=24 * GiB,
        )
    message = str(refused.value)
    for part in ("weights 5120 MiB", "KV cache 20.0 GiB", "runtime ~400 MiB", "25.4 GiB"):
        assert part in message, message
    assert "24.0 GiB is available" in message and "--kv-cache-gib" in message


def test_the_estimate_of_a_gguf_file_is_its_blocks_as_stored_or_its_values_as_floats() -> None:
    path = embedded_model_path()
    size = path.stat().st_size
    blocks = estimated_weight_bytes(path, "gguf", torch.float32)
    assert 0.95 * size < blocks < size  # the blocks, less the header and vocabulary
    dense = estimated_weight_bytes(path, "none", torch.float32)
    assert dense == pytest.approx(134.5e6 * 4, rel=0.01)  # 134.5M values in float32
    assert estimated_weight_bytes(path, "none", torch.bfloat16) == dense // 2


def test_the_machine_and_available_memory_are_read() -> None:
    assert 0 < available_bytes() <= machine_bytes()


def test_the_report_lines_say_what_each_share_is() -> None:
    budget = MemoryBudget(
        weight_bytes_by_kind={"Q4_K": 500 * MiB, "Q6_K": 138 * MiB, "float32": MiB // 4},
        weight_mapped_bytes=600 * MiB,
        kv_cache_bytes=256 * MiB,
        kv_cache_blocks=512,
        kv_cache_tokens=8192,
        runtime_bytes=250 * MiB,
        machine_bytes=24 * GiB,
    )
    assert budget.weight_bytes == 638 * MiB + MiB // 4
    assert budget.total_bytes == budget.weight_bytes + 506 * MiB
    lines = dict(budget.lines())
    assert lines["weights"].startswith("638 MiB (Q4_K 500 MiB, Q6_K 138 MiB, float32 0.2 MiB")
    assert "600 MiB mapped from the file" in lines["weights"]
    assert lines["KV cache"] == "256 MiB (512 blocks, 8192 tokens)"
    assert lines["total"] == "1144 MiB of 24.0 GiB"
    assert budget.log_fields()["kv_cache_tokens"] == 8192


def test_a_worker_whose_kv_cache_cannot_fit_refuses_to_start_naming_the_numbers() -> None:
    """A real worker process, told to take a KV cache larger than the machine: it exits at
    once with the budget, having read no weight."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "worker",
            "--port",
            "0",
            "--kv-cache-gib",
            str(2 * machine_bytes() // GiB),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode != 0
    assert "not enough memory" in run.stderr, run.stderr[-2000:]
    assert "(--kv-cache-gib)" in run.stderr and "is available" in run.stderr


def test_a_truncated_gguf_file_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """The index checks every tensor against the file's length before any weight is mapped."""
    from services.common.gguf_index import GGUFIndex
    from services.contracts.errors import ModelLoadError

    source = embedded_model_path()
    cut = tmp_path / "cut.gguf"
    with source.open("rb") as whole, cut.open("wb") as part:
        part.write(whole.read(source.stat().st_size // 2))
    with pytest.raises(
        ModelLoadError, match=r"ends past the end of .*cut\.gguf \(a truncated file"
    ):
        GGUFIndex(cut)
