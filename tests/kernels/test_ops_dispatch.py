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


@pytest.mark.parametrize("backend_name", ["torch", "triton", "cpu_extension"])
def test_window_and_softcap_reach_every_backend(
    backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through kernels.ops, each backend computes what the torch reference computes with the
    sliding window and the logit cap, which both change the result here."""
    from kernels import attention_torch, cpu_extension
    from tests.kernels.paged_kv_factory import make_paged_kv

    if backend_name == "cpu_extension":
        assert cpu_extension.load(), "the C++ kernels must build on this machine"
        monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(backend.BACKEND_ENV_VAR, backend_name)
    g = torch.Generator().manual_seed(21)
    kv = make_paged_kv([40, 9, 33], 2, 64, 16, torch.float32, g)
    features = {"sliding_window": 12, "logit_softcap": 2.0}
    query = torch.randn(3, 4, 64, generator=g) * 3
    decode_args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125)
    got = ops.paged_decode_attention(*decode_args, **features)
    want = attention_torch.paged_decode_attention(*decode_args, **features)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (want - attention_torch.paged_decode_attention(*decode_args)).abs().max() > 0.05
    if backend_name == "cpu_extension":
        return  # prefill has no C++ kernel
    new = torch.randn(14, 4, 64, generator=g) * 3
    key, value = torch.randn(14, 2, 64, generator=g), torch.randn(14, 2, 64, generator=g)
    cu_seqlens = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    prefill_args = (new, key, value, kv.k_cache, kv.v_cache, cu_seqlens, kv.lens, kv.block_tables)
    got = ops.prefill_attention(*prefill_args, 0.125, **features)
    want = attention_torch.prefill_attention(*prefill_args, 0.125, **features)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (want - attention_torch.prefill_attention(*prefill_args, 0.125)).abs().max() > 0.05
