"""--kv-offload-gib: no host tier below a CPU's pool (which is host memory already); the
refusal names the flag, says why and what to use instead, as one line from the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.engine.config import EngineConfig
from services.launcher import StackConfig
from services.worker.config import WorkerConfig


@pytest.mark.parametrize("config", [WorkerConfig, EngineConfig, StackConfig])
def test_a_host_tier_is_refused_on_a_cpu_saying_what_to_use(config: type) -> None:
    with pytest.raises(ValueError, match="--kv-offload-gib") as refused:
        config(kv_offload_gib=2.0)
    message = str(refused.value)
    assert "host memory" in message
    assert "--kv-cache-gib" in message and "--kv-disk-dir" in message
    config(kv_offload_gib=0.0)  # the default: no host tier, no refusal


def test_on_a_gpu_it_is_not_built_yet() -> None:
    with pytest.raises(ValueError, match="not built yet"):
        WorkerConfig(device="cuda", kv_offload_gib=2.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        WorkerConfig(kv_offload_gib=-1.0)


def test_the_cli_refuses_in_one_line_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "worker", "--kv-offload-gib", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("llmserve: error: --kv-offload-gib:")
    assert "Traceback" not in done.stderr
