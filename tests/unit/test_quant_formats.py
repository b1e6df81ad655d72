"""Format flags, KV cache sizing per format, and GGUF Q4 blocks decoded into int4 codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.cli import main
from services.engine.config import EngineConfig
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.quantization.formats import (
    InvalidFormatError,
    kv_cache_torch_dtype,
    resolve_quantization,
)


def smollm2_spec(dtype: torch.dtype, group_size: int = 8) -> KVCacheSpec:
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    return KVCacheSpec(30, 3, 64, 16, dtype, group_size)


def test_defaults_keep_the_model_dtype_and_float_weights() -> None:
    assert EngineConfig().kv_cache_dtype == "auto" and EngineConfig().quantization == "auto"
    assert WorkerConfig().kv_cache_dtype == "auto" and WorkerConfig().quantization == "auto"
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("int8", torch.bfloat16) == torch.int8


def test_llama_cpp_arithmetic_caches_float16_by_default() -> None:
    """`--quantization gguf` on a CPU is llama.cpp's arithmetic, whose default KV cache is
    float16; gguf-exact caches float32; other formats and GPUs keep the model dtype; a named
    dtype wins."""
    assert kv_cache_torch_dtype("auto", torch.float32, quantization="gguf") == torch.float16
    assert kv_cache_torch_dtype("auto", torch.float32, quantization="gguf-exact") == torch.float32
    assert kv_cache_torch_dtype("auto", torch.float32, quantization="none") == torch.float32
    assert kv_cache_torch_dtype("auto", torch.bfloat16, quantization="gguf") == torch.bfloat16
    # The exact mode's cache is float32 whatever the model dtype; a named dtype still wins.
    assert kv_cache_torch_dtype("auto", torch.bfloat16, quantization="gguf-exact") == torch.float32
    assert kv_cache_torch_dtype("auto", torch.float16, quantization="gguf-exact") == torch.float32
    named = kv_cache_torch_dtype("bfloat16", torch.float32, quantization="gguf-exact")
    assert named == torch.bfloat16
    cuda = kv_cache_torch_dtype("auto", torch.float32, quantization="gguf", device="cuda:0")
    assert cuda == torch.float32
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        assert kv_cache_torch_dtype(name, torch.float32, quantization="gguf") == dtype


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("kv_cache_dtype", "fp8", "--kv-cache-dtype"),
        ("quantization", "int3", "--quantization"),
        ("kv_cache_group_size", 6, "--kv-cache-group-size"),
    ],
)
def test_bad_values_name_their_flag(field: str, value: object, flag: str) -> None:
    for config in (EngineConfig, WorkerConfig):
        with pytest.raises(InvalidFormatError, match=flag):
            config(**{field: value})


def test_cli_reports_a_bad_flag_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quantization", "int3"]) == 2
    error = capsys.readouterr().err
    assert "--quantization must be one of none, int8, w8a8, int4, nf4, gguf" in error


def test_auto_quantization_keeps_the_model_files_format(tmp_path: Path) -> None:
    assert resolve_quantization("auto", Path("model.Q4_1.gguf")) == "gguf"
    assert resolve_quantization("auto", tmp_path) == "none"  # a Hugging Face directory
    assert resolve_quantization("int4", Path("model.Q4_1.gguf")) == "int4"
    assert EngineConfig(quantization="auto").quantization == "auto"


def test_int8_kv_bytes_and_block_counts() -> None:
    fp32, bf16 = smollm2_spec(torch.float32), smollm2_spec(torch.bfloat16)
    int8_g8, int8_g64 = smollm2_spec(torch.int8, 8), smollm2_spec(torch.int8, 64)
    elements = 2 * 30 * 3 * 64
    assert bf16.bytes_per_token == 2 * elements
    assert int8_g8.bytes_per_token == elements * (1 + 2 / 8)  # fp16 scale per 8 values
    assert int8_g64.bytes_per_token == elements * (1 + 2 / 64)
    budget = 1 << 30
    blocks = {s: s.num_blocks_for_budget(budget) for s in (fp32, bf16, int8_g8, int8_g64)}
    assert blocks[int8_g8] / blocks[bf16] == pytest.approx(1.6, rel=1e-3)
    assert blocks[int8_g8] / blocks[fp32] == pytest.approx(3.2, rel=1e-3)
    assert blocks[int8_g64] / blocks[bf16] >= 1.9


def test_group_size_must_divide_head_dim() -> None:
    with pytest.raises(InvalidFormatError, match="--kv-cache-group-size 128"):
        smollm2_spec(torch.int8, 128)


def test_int8_cache_allocates_scales_and_copies_them() -> None:
    spec = KVCacheSpec(2, 2, 16, 4, torch.int8, 8)
    cache = PagedKVCache(spec, 3, "cpu")
    assert cache.scales is not None and cache.scales.shape == (2, 2, 3, 4, 2, 2)
    layer = cache.layers[1]
    assert layer.key_scale is not None and layer.value_scale is not None
    layer.key[0].fill_(7)
    layer.key_scale[0].fill_(0.5)
    cache.copy_blocks([(0, 2)])
    assert (cache.layers[1].key[2] == 7).all() and (cache.layers[1].key_scale[2] == 0.5).all()
    assert PagedKVCache(smollm2_spec(torch.float32), 1, "cpu").layers[0].key_scale is None
