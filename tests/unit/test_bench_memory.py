"""The real-size shapes, their pure parts: the parameter counts and the Q4_K_M layout the 8B
file is written with."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from benchmarks.model_shapes import SHAPES, check_types, parse_shape_ref
from benchmarks.synthetic_gguf import (
    TensorPlan,
    llama_tensor_plan,
    q4_k_m_type,
    random_blocks,
    use_more_bits,
)

# ---- shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "vocab_size", "published"),
    [
        ("llama-3.2-1b", 128256, 1_235_814_400),
        ("llama-3.2-3b", 128256, 3_212_749_824),
        ("qwen2.5-1.5b", 151936, 1_543_714_304),
        ("gemma-3-1b", 262144, 999_885_952),
        ("llama-3.1-8b", 128256, 8_030_261_248),
    ],
)
def test_parameter_counts_match_the_published_models_with_their_own_vocabulary(
    name: str, vocab_size: int, published: int
) -> None:
    assert replace(SHAPES[name], vocab_size=vocab_size).num_params == published


def test_with_the_embedded_vocabulary_llama_1b_has_1_07b_parameters() -> None:
    assert SHAPES["llama-3.2-1b"].num_params == 1_073_809_408


def test_shape_references_and_types_are_checked() -> None:
    shape, quant_type = parse_shape_ref("llama-3.2-1b:q4_0")
    assert shape.name == "llama-3.2-1b" and quant_type == "Q4_0"
    assert parse_shape_ref("llama-3.1-8b") == (SHAPES["llama-3.1-8b"], "Q4_K_M")
    with pytest.raises(ValueError, match="unknown shape"):
        parse_shape_ref("llama-9b")
    with pytest.raises(ValueError, match="Q4_K_M"):
        check_types(SHAPES["llama-3.1-8b"], ["Q4_0"])  # the direct writer makes Q4_K_M only
    assert check_types(SHAPES["gemma-3-1b"], ["Q4_K_M", "q8_0", "Q4_K_M"]) == ["Q4_K_M", "Q8_0"]


# ---- the 8B file's Q4_K_M layout (llama-quant.cpp's rule) ---------------------------------


def test_more_bits_on_half_the_layers_as_llama_quantize_chooses() -> None:
    chosen = [layer for layer in range(32) if use_more_bits(layer, 32)]
    assert chosen == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [layer for layer in range(16) if use_more_bits(layer, 16)] == [
        0, 1, 4, 7, 10, 13, 14, 15,
    ]  # fmt: skip


def test_q4_k_m_types_by_tensor() -> None:
    assert q4_k_m_type("output.weight", 32, tied_embeddings=False) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 32, tied_embeddings=False) == "Q4_K"
    assert q4_k_m_type("token_embd.weight", 32, tied_embeddings=True) == "Q6_K"
    assert q4_k_m_type("blk.6.attn_v.weight", 32, tied_embeddings=False) == "Q6_K"
    assert q4_k_m_type("blk.7.attn_v.weight", 32, tied_embeddings=False) == "Q4_K"
    assert q4_k_m_type("blk.27.ffn_down.weight", 32, tied_embeddings=False) == "Q6_K"
    assert q4_k_m_type("blk.26.ffn_down.weight", 32, tied_embeddings=False) == "Q4_K"
    for other in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert q4_k_m_type(f"blk.0.{other}.weight", 32, tied_embeddings=False) == "Q4_K"
    for vector in ("blk.0.attn_norm.weight", "output_norm.weight", "rope_freqs.weight"):
        assert q4_k_m_type(vector, 32, tied_embeddings=False) == "F32"


def test_the_8b_plan_has_llama_cpps_tensors_and_size() -> None:
    shape = SHAPES["llama-3.1-8b"]
    plans = llama_tensor_plan(shape)
    by_name = {plan.name: plan for plan in plans}
    assert len(plans) == 2 + 9 * 32 + 2
    assert [p.name for p in plans[:2]] == ["token_embd.weight", "rope_freqs.weight"]
    assert plans[-1].name == "output.weight"
    q6 = sorted(p.name for p in plans if p.type_name == "Q6_K")
    assert len(q6) == 16 + 16 + 1
    assert (by_name["blk.0.attn_k.weight"].rows, by_name["blk.0.attn_k.weight"].cols) == (
        1024,
        4096,
    )
    assert by_name["blk.0.ffn_down.weight"].cols == 14336
    assert by_name["rope_freqs.weight"].cols == 64
    # Q4_K: 144 bytes per 256 values, Q6_K: 210; about 4.5 GB in all (4.9 with Llama's vocab).
    assert by_name["output.weight"].nbytes == 49152 * 16 * 210
    total = sum(plan.nbytes for plan in plans)
    assert 4.4e9 < total < 4.5e9


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_random_blocks_decode_to_small_finite_weights(type_name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    plan = TensorPlan("blk.0.attn_q.weight", 8, 512, type_name)
    data = random_blocks(plan, np.random.default_rng(0))
    assert data.shape == (8, plan.nbytes // 8)
    weights = quants.dequantize(data, GGMLQuantizationType[type_name])
    assert weights.shape == (8, 512) and np.isfinite(weights).all()
    assert 0.01 < float(weights.std()) < 0.05 and abs(float(weights.mean())) < 0.005
