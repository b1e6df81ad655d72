"""The C++ attention, KV-write and LoRA kernels built other ways than this machine's main
build: the portable scalar build (-DLLMSERVE_SCALAR_KERNELS), the AVX-512 backend on emulated
intrinsics where the CPU lacks AVX-512, and the AVX2 backend where it has AVX-512. Each variant
builds its own library in a subprocess (tests/kernels/cpu_kernel_variant.py), about a minute
the first time; later runs reuse the cached build.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_extension

REPO_ROOT = Path(__file__).resolve().parents[2]


def _cpu_has_avx512() -> bool:
    return "avx512f" in cpu_extension.cpu_flags_line().split()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["scalar", "avx512-emulated", "avx2"])
def test_kernel_variant_matches_torch(variant: str) -> None:
    if variant == "avx512-emulated" and _cpu_has_avx512():
        pytest.skip("the main build already runs the real AVX-512 backend here")
    if variant == "avx2" and not _cpu_has_avx512():
        pytest.skip("the main build already runs the AVX2 backend here")
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.cpu_kernel_variant", variant],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "cases match the torch references" in result.stdout
