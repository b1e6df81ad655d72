"""kernels.ops routes each op to the backend `kernels.backend` picks, and a CPU-only import of
kernels.ops never imports triton."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import backend, ops

# op name -> Triton module implementing it
TRITON_MODULES = {
    "write_kv_cache": "triton_kv_cache",
    "paged_decode_attention": "triton_decode_attention",
    "prefill_attention": "triton_prefill_attention",
    "rms_norm": "triton_norm",
    "fused_add_rms_norm": "triton_norm",
    "apply_rotary": "triton_rotary",
    "silu_and_mul": "triton_activation",
    "int8_gemm": "triton_quant_gemm",
}
NUM_ARGS = {
    "write_kv_cache": 5,
    "paged_decode_attention": 6,
    "prefill_attention": 9,
    "rms_norm": 3,
    "fused_add_rms_norm": 4,
    "apply_rotary": 4,
    "silu_and_mul": 1,
    "int8_gemm": 3,
}


@pytest.mark.parametrize("op_name", list(TRITON_MODULES))
def test_forced_triton_backend_calls_the_triton_module(
    op_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"kernels.{TRITON_MODULES[op_name]}")
    calls: list[int] = []
    monkeypatch.setattr(module, op_name, lambda *args, **kwargs: calls.append(len(args)))
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    getattr(ops, op_name)(*[torch.zeros(1)] * NUM_ARGS[op_name])
    assert len(calls) == 1 and calls[0] >= NUM_ARGS[op_name]


def test_cpu_import_does_not_import_triton() -> None:
    code = "import sys, kernels.ops; assert 'triton' not in sys.modules, 'triton imported'"
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
