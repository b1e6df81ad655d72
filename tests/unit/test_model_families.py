"""The model registry reads each family's switches from transformers' own configs (as
config.json holds them) and refuses what it cannot serve, naming the missing feature."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.contracts.errors import ModelLoadError
from services.worker.model.families import FAMILIES, hf_family, hf_model_architecture

transformers = pytest.importorskip("transformers")

SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def saved(config: Any, tmp_path: Path) -> dict[str, Any]:
    """The dict transformers writes to config.json."""
    config.save_pretrained(tmp_path)
    return dict(json.loads((tmp_path / "config.json").read_text()))


def read(config: Any, tmp_path: Path):  # type: ignore[no-untyped-def]
    saved(config, tmp_path)
    return hf_model_architecture(tmp_path)[1]


def test_every_family_has_a_unique_name_and_types() -> None:
    names = [f.name for f in FAMILIES]
    types = [t for f in FAMILIES for t in f.hf_model_types]
    assert len(set(names)) == len(names) and len(set(types)) == len(types)


def test_mistral_windows_every_layer(tmp_path: Path) -> None:
    arch = read(transformers.MistralConfig(**SMALL, sliding_window=64), tmp_path)
    assert arch.family == "mistral"
    assert arch.layer_sliding_windows == (64,) * 6
    assert arch.largest_window == 64


def test_qwen2_has_qkv_bias_and_windows_only_when_asked(tmp_path: Path) -> None:
    arch = read(transformers.Qwen2Config(**SMALL), tmp_path)
    assert arch.attention_bias and arch.layer_sliding_windows == ()
    windowed = transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=2
    )
    arch = read(windowed, tmp_path)
    assert arch.layer_sliding_windows == (0, 0, 32, 32, 32, 32)


def test_qwen3_has_per_head_qk_norm_and_its_own_head_dim(tmp_path: Path) -> None:
    arch = read(transformers.Qwen3Config(**SMALL, head_dim=40), tmp_path)
    assert arch.qk_norm == "per_head" and arch.head_dim == 40 and not arch.attention_bias


def test_gemma2_switches(tmp_path: Path) -> None:
    config = transformers.Gemma2Config(
        **SMALL,
        head_dim=16,
        sliding_window=32,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    arch = read(config, tmp_path)
    assert arch.post_norms and arch.pre_norms and arch.hidden_act == "gelu_tanh"
    assert arch.embedding_multiplier == pytest.approx(8.0)
    assert arch.layer_sliding_windows == (32, 0, 32, 0, 32, 0)
    assert arch.query_scale == pytest.approx(24**-0.5)
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    assert arch.tie_word_embeddings


def test_gemma3_has_five_local_layers_to_one_global_with_their_own_rope(tmp_path: Path) -> None:
    config = transformers.Gemma3TextConfig(
        **SMALL,
        head_dim=16,
        sliding_window=32,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    arch = read(config, tmp_path)
    assert arch.layer_sliding_windows == (32, 32, 32, 32, 32, 0)
    assert arch.qk_norm == "per_head"
    assert arch.rope.theta == 1e6 and arch.rope.scaling is not None
    assert arch.rope.scaling["rope_type"] == "linear"
    assert arch.local_rope is not None and arch.local_rope.theta == 1e4
    assert arch.local_rope.scaling is None
    assert arch.rope_of_layer(0) is arch.local_rope and arch.rope_of_layer(5) is arch.rope


def test_gemma3_hub_style_keys(tmp_path: Path) -> None:
    config = {
        "model_type": "gemma3_text",
        **SMALL,
        "head_dim": 16,
        "sliding_window": 32,
        "sliding_window_pattern": 3,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = hf_model_architecture(tmp_path)[1]
    assert arch.layer_sliding_windows == (32, 32, 0, 32, 32, 0)
    assert arch.local_rope is not None and arch.local_rope.theta == 1e4
    assert arch.rope.theta == 1e6


def test_phi3_longrope_and_partial_rotary(tmp_path: Path) -> None:
    pairs = 6  # head_dim 16 x 0.75 = 12 rotated dims
    config = transformers.Phi3Config(
        **SMALL,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        partial_rotary_factor=0.75,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * pairs,
            "long_factor": [2.0] * pairs,
            "original_max_position_embeddings": 128,
            "partial_rotary_factor": 0.75,
        },
    )
    arch = read(config, tmp_path)
    assert arch.rope.partial_rotary_factor == 0.75
    assert arch.rope.scaling is not None and arch.rope.scaling["rope_type"] == "longrope"
    assert arch.rope.scaling["original_max_position_embeddings"] == 128


def test_granite_multipliers(tmp_path: Path) -> None:
    config = transformers.GraniteConfig(
        **SMALL,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
    )
    arch = read(config, tmp_path)
    assert arch.embedding_multiplier == 12.0 and arch.residual_multiplier == 0.22
    assert arch.query_scale == 0.015625 and arch.logits_divisor == 8.0


def test_smollm3_skips_rope_on_every_fourth_layer(tmp_path: Path) -> None:
    arch = read(transformers.SmolLM3Config(**{**SMALL, "num_hidden_layers": 8}), tmp_path)
    assert arch.layer_uses_rope == (True, True, True, False, True, True, True, False)


def test_olmo2_has_post_norms_only_and_qk_norm_across_heads(tmp_path: Path) -> None:
    arch = read(transformers.Olmo2Config(**SMALL), tmp_path)
    assert not arch.pre_norms and arch.post_norms and arch.qk_norm == "across_heads"


def test_unknown_model_type_is_refused_naming_it() -> None:
    with pytest.raises(ModelLoadError, match="model_type 'falcon' is not supported"):
        hf_family({"model_type": "falcon"})


def test_multimodal_gemma3_names_its_text_model() -> None:
    with pytest.raises(ModelLoadError, match="gemma3_text"):
        hf_family({"model_type": "gemma3"})


def test_unsupported_rope_scaling_names_it(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ModelLoadError, match="rope scaling 'dynamic' is not supported"):
        read(config, tmp_path)
