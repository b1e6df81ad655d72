"""The C++ attention, KV-write and LoRA kernels built other ways than this machine's main
build: the product's portable build (`baseline`: the scalar kernels alone), the AVX-512 backend
on emulated intrinsics where the CPU lacks AVX-512, and the product's AVX2 build where it has
AVX-512. Each variant is loaded in a subprocess (tests/kernels/cpu_kernel_variant.py); the
product's builds are the ones tests/kernels/test_cpu_extension.py builds too, made once in
llmserve's cache (a few minutes from an empty one) and shared.

The fused decode step (llama_decode.cpp, with the GEMM kernels it calls) runs its own tests
again on the product's avx2 build (kernels/cpu_extension.py's variant, LLMSERVE_CPU_VARIANT)
where the CPU has AVX-512: the main build runs the AVX-512 code there, and its scalar code runs
in process (tests/kernels/test_llama_decode_families.py). On a CPU without AVX-512 the main
build is the AVX2 one, and the step's AVX-512 code cannot run: only the primitives it builds
on (exp, tanh) run there, emulated, in the attention kernels above.
"""

from __future__ import annotations

import os
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


FUSED_DECODE_TESTS = [
    "tests/kernels/test_llama_decode.py",
    "tests/kernels/test_llama_decode_families.py",
]


@pytest.mark.slow
def test_fused_decode_on_the_avx2_build() -> None:
    if not _cpu_has_avx512():
        pytest.skip("the main build already runs the AVX2 backend here")
    env = {**os.environ, cpu_extension.VARIANT_ENV_VAR: "avx2"}
    isa = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kernels import cpu_extension; assert cpu_extension.load();"
            " print(cpu_extension.ops().cpu_kernel_isa())",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert isa.stdout.strip() == "avx2", (isa.stdout + isa.stderr)[-3000:]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FUSED_DECODE_TESTS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
