"""kernels.ops routes each op to the backend `kernels.backend` picks, and a CPU-only import of
kernels.ops never imports triton."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
    "sample_tokens": "triton_sampling",
    "int8_gemm": "triton_quant_gemm",
    "int4_gemm": "triton_quant_gemm",
}
NUM_ARGS = {
    "write_kv_cache": 5,
    "paged_decode_attention": 6,
    "prefill_attention": 9,
    "rms_norm": 3,
    "fused_add_rms_norm": 4,
    "apply_rotary": 4,
    "silu_and_mul": 1,
    "sample_tokens": 5,
    "int8_gemm": 3,
    "int4_gemm": 4,
}


@pytest.mark.parametrize("op_name", list(TRITON_MODULES))
def test_forced_triton_backend_calls_the_triton_module(
    op_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"kernels.{TRITON_MODULES[op_name]}")
    sentinel = object()
    monkeypatch.setattr(module, op_name, lambda *args, **kwargs: sentinel)
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    args = [torch.zeros(1)] * NUM_ARGS[op_name]
    result = getattr(ops, op_name)(*args)
    assert result is sentinel or op_name == "write_kv_cache"  # write returns None


def test_cpu_import_does_not_import_triton() -> None:
    code = "import sys, kernels.ops; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
