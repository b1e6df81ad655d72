"""Every Triton kernel compiles for an H100 (sm_90) at the 7B shapes, on this GPU-less machine.

The interpreter runs kernels as numpy programs, so it misses what only the compiler sees
(loop-carried value types, shared-memory limits, ops without a GPU lowering). This runs
`scripts/gpu_kernel_check.py --compile-only`, which compiles each launch through the ptxas in
the triton wheel instead of running it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_all_kernels_compile_for_sm90() -> None:
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "scripts/gpu_kernel_check.py", "--compile-only"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line.split()[0] for line in result.stdout.splitlines() if " sm_90 " in line]
    expected = {
        "_decode_split_kernel",
        "_decode_merge_kernel",
        "_write_kv_cache_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_gated_activation_kernel",
        "_quantize_rows_kernel",
        "_int8_gemm_kernel",
        "_prefill_kernel",
        "_lora_shrink_kernel",
        "_lora_expand_kernel",
    }
    assert set(compiled) == expected
