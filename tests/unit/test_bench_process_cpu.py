"""CPU by process: /proc reading and the per-token arithmetic."""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks.process_cpu import (
    CLIENT,
    CpuSnapshot,
    ProcessCpu,
    cpu_rows,
    cpu_seconds,
    cpu_table,
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_cpu_seconds_reads_a_live_process_and_not_a_gone_one() -> None:
    spent = cpu_seconds(os.getpid())
    assert spent is not None and spent > 0
    sum(i * i for i in range(2_000_000))  # burn a little CPU
    later = cpu_seconds(os.getpid())
    assert later is not None and later >= spent
    assert cpu_seconds(2**22 + 12345) is None  # beyond pid_max: never a process


def test_snapshot_always_has_the_client() -> None:
    snapshot = ProcessCpu({"gone": 2**22 + 12345}).snapshot()
    assert CLIENT in snapshot.cpu_s and "gone" not in snapshot.cpu_s


def test_rows_per_token_and_core_share() -> None:
    before = CpuSnapshot(10.0, {"worker": 1.0, "scheduler": 0.5, "new": 0.0})
    after = CpuSnapshot(12.0, {"worker": 4.0, "scheduler": 0.7, "late": 9.0})
    rows = cpu_rows(before, after, output_tokens=200)
    assert [row.process for row in rows] == ["worker", "scheduler", "total"]
    worker, scheduler, total = rows
    assert worker.cpu_s == pytest.approx(3.0) and worker.ms_per_token == pytest.approx(15.0)
    assert worker.core_share == pytest.approx(1.5)
    assert scheduler.ms_per_token == pytest.approx(1.0)
    assert total.cpu_s == pytest.approx(3.2) and total.core_share == pytest.approx(1.6)
    table = cpu_table(rows)
    assert "| worker" in table and "CPU ms per output token" in table
