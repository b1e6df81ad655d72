"""`llmserve estimate` against answers computed by hand (and parameter counts Hugging Face
reports for the real checkpoints)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.cli import main
from services.estimate.catalog import DEFAULT_GPUS, KNOWN_GPUS, KNOWN_MODELS, find_gpu
from services.estimate.command import load_gpus_file, load_model_shape
from services.estimate.roofline import (
    Device,
    decode_flops_per_token,
    decode_throughput,
    estimate,
    kv_bytes_per_token,
    max_concurrent_requests,
    speed_of_light_tokens_per_s,
    weight_bytes,
)

LLAMA_2_7B = KNOWN_MODELS["llama-2-7b"]
A100_80G = KNOWN_GPUS["a100-80g"]


@pytest.mark.parametrize(
    ("name", "num_params"),
    [
        # The safetensors parameter counts of the published checkpoints.
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("smollm2-135m", 134_515_008),
        ("mistral-7b", 7_241_732_096),
        ("qwen2-7b", 7_615_616_512),
    ],
)
def test_parameter_counts_match_the_checkpoints(name: str, num_params: int) -> None:
    assert KNOWN_MODELS[name].num_params == num_params


def test_llama_2_7b_fp16_weights_are_13_5_gb_and_shrink_with_the_dtype() -> None:
    assert weight_bytes(LLAMA_2_7B, "fp16") == 2 * 6_738_415_616
    assert weight_bytes(LLAMA_2_7B, "fp16") / 1e9 == pytest.approx(13.5, abs=0.05)
    assert weight_bytes(LLAMA_2_7B, "int8") == 6_738_415_616
    assert weight_bytes(LLAMA_2_7B, "int4") == 6_738_415_616 / 2


def test_kv_bytes_per_token() -> None:
    # 2 (K and V) * 32 layers * 32 KV heads * 128 head_dim * 2 bytes
    assert kv_bytes_per_token(LLAMA_2_7B, "fp16") == 524_288
    assert kv_bytes_per_token(LLAMA_2_7B, "int8") == 262_144
    # GQA: 8 KV heads instead of 32, a quarter of the cache
    assert kv_bytes_per_token(KNOWN_MODELS["llama-3-8b"], "bf16") == 131_072
    # SmolLM2-135M: 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(KNOWN_MODELS["smollm2-135m"], "fp16") == 23_040


def test_unknown_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="fp16"):
        kv_bytes_per_token(LLAMA_2_7B, "fp12")


def test_decode_flops_are_two_per_matmul_weight_plus_attention() -> None:
    # Matmul weights: every parameter except the embedding lookup (untied) and the norms.
    matmul = 6_738_415_616 - 32000 * 4096 - (2 * 32 + 1) * 4096
    assert decode_flops_per_token(LLAMA_2_7B, 0) == 2 * matmul
    assert (
        decode_flops_per_token(LLAMA_2_7B, 4096) - decode_flops_per_token(LLAMA_2_7B, 0)
        == 4 * 32 * 32 * 128 * 4096
    )


def test_llama_2_7b_fp16_on_a100_80g_at_4096_tokens() -> None:
    row = estimate(LLAMA_2_7B, A100_80G, context_len=4096, weight_dtype="fp16", kv_dtype="fp16")
    # (0.9 * 80e9 - 13.477e9) / (524288 * 4096 = 2.147e9 per request) = 27.25
    assert row.max_requests == 27
    assert row.batch == 27
    weights = 13_476_831_232
    assert row.memory_latency_s == pytest.approx((weights + 27 * 2**31) / 2039e9)
    assert row.memory_latency_s * 1e3 == pytest.approx(35.05, abs=0.01)
    flops = decode_flops_per_token(LLAMA_2_7B, 4096)
    assert row.compute_latency_s == pytest.approx(27 * flops / 312e12)
    assert row.bound == "memory"
    assert row.tokens_per_s == pytest.approx(27 / row.memory_latency_s)
    assert row.usd_per_million_tokens == pytest.approx(1.80 / (row.tokens_per_s * 3600) * 1e6)


def test_int8_kv_cache_doubles_the_requests_that_fit() -> None:
    # The seeds' KV cache quantization claim: 2x users from the same memory.
    fp16 = estimate(LLAMA_2_7B, A100_80G, weight_dtype="fp16", kv_dtype="fp16")
    int8 = estimate(LLAMA_2_7B, A100_80G, weight_dtype="fp16", kv_dtype="int8")
    assert int8.max_requests == 54 == 2 * fp16.max_requests


def test_large_batches_turn_compute_bound() -> None:
    h100 = KNOWN_GPUS["h100-sxm"]
    short = estimate(KNOWN_MODELS["llama-3-8b"], h100, context_len=128)
    assert short.max_requests > 3000
    assert short.bound == "compute"
    capped = estimate(KNOWN_MODELS["llama-3-8b"], h100, context_len=128, max_batch=8)
    assert capped.batch == 8 and capped.bound == "memory"


def test_a_model_larger_than_the_gpu_does_not_fit() -> None:
    row = estimate(KNOWN_MODELS["llama-3-70b"], KNOWN_GPUS["l4"], weight_dtype="bf16")
    assert row.max_requests == 0 and row.batch == 0
    assert row.bound == "does not fit"
    assert math.isnan(row.tokens_per_s) and math.isnan(row.usd_per_million_tokens)


def test_max_concurrent_requests_floors_and_never_goes_negative() -> None:
    assert max_concurrent_requests(100.0, 40.0, 1.0, 20) == 3
    assert max_concurrent_requests(100.0, 120.0, 1.0, 20) == 0


def test_the_seeds_throughput_column_is_requests_over_step_latency() -> None:
    # Seeds' hardware table, RTX 4090 row: 48 requests, 29.76 ms memory latency -> 1612.8 tok/s
    assert decode_throughput(48, 29.76e-3) == pytest.approx(1612.9, abs=0.1)
    # ... and V100-PCIe-16G: 16 requests, 22.22 ms -> 720 tok/s
    assert decode_throughput(16, 22.22e-3) == pytest.approx(720.1, abs=0.1)


def test_speed_of_light_is_bandwidth_over_bytes_per_token() -> None:
    assert speed_of_light_tokens_per_s(0.27e9, 27e9) == pytest.approx(100.0)


def test_gpu_names_are_case_and_space_insensitive() -> None:
    assert find_gpu("RTX 4090") is KNOWN_GPUS["rtx-4090"]
    assert find_gpu("h100-sxm").memory_gb == 80
    with pytest.raises(ValueError, match="unknown GPU"):
        find_gpu("B200")
    assert set(DEFAULT_GPUS) <= set(KNOWN_GPUS)


def test_gpus_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(
        json.dumps(
            [
                {"name": "X", "memory_gb": 32, "bandwidth_gb_s": 1000, "tflops": 100},
                {
                    "name": "Y",
                    "memory_gb": 48,
                    "bandwidth_gb_s": 900,
                    "tflops": 150,
                    "usd_per_hour": 1.25,
                },
            ]
        )
    )
    x, y = load_gpus_file(path)
    assert x == Device("X", 32.0, 1000.0, 100.0, None)
    assert y.usd_per_hour == 1.25
    path.write_text(json.dumps([{"name": "Z", "memory_gb": 32}]))
    with pytest.raises(ValueError, match="bandwidth_gb_s"):
        load_gpus_file(path)


def test_hf_config_json_and_built_in_names_give_the_same_shape(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_file, _ = load_model_shape(str(tmp_path / "config.json"))
    from_dir, _ = load_model_shape(str(tmp_path))
    built_in, _ = load_model_shape("Llama-2-7B")
    assert from_file.num_params == from_dir.num_params == built_in.num_params
    assert kv_bytes_per_token(from_dir, "fp16") == 524_288
    with pytest.raises(ValueError, match="built-in name"):
        load_model_shape(str(tmp_path / "missing"))


@pytest.mark.slow  # parsing the GGUF metadata (49k vocabulary strings) takes seconds
def test_the_embedded_gguf_has_the_built_in_smollm2_shape() -> None:
    embedded, source = load_model_shape(None)
    assert source.endswith(".gguf")
    built_in = KNOWN_MODELS["smollm2-135m"]
    assert embedded.num_params == built_in.num_params
    assert kv_bytes_per_token(embedded, "bf16") == kv_bytes_per_token(built_in, "bf16")


def test_cli_prints_one_row_per_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "estimate",
            "--model",
            "llama-2-7b",
            "--gpu",
            "A100-80G",
            "--gpu",
            "L4",
            "--weight-dtype",
            "fp16",
            "--kv-dtype",
            "fp16",
            "--no-cpu",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| A100-80G") or "| L4 " in line]
    assert len(rows) == 2
    assert "|           27 |" in rows[0]  # max requests, as computed above
    assert "524,288 bytes/token" in out
    assert "this CPU" not in out


def test_cli_rejects_an_unknown_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "llama-2-7b", "--gpu", "B200", "--no-cpu"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
