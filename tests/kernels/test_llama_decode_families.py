"""The fused decode step (kernels/csrc/llama_decode.cpp) on every family the worker serves,
against the eager model: a tiny model of each, its architecture read by the family's own
reader from the config that transformers' config class writes (tests/model/tiny_models.py's
families: post-norms, GeGLU, soft-capped attention, per-layer windows and ropes, layers
without rope, multipliers, QK-norm per head and across heads), with random GGUF blocks or
dense weights. Logits and KV writes are held to tests/kernels/fused_decode_bounds.py.

The caches here are float32. A float16 or int8 cache may store a key one step of its format
apart in the two paths (a value within the paths' rounding difference of a boundary), and
attention spreads that step: a difference of the cache format, not of the family's switches,
whose write and attention code every family shares; test_llama_decode.py covers those caches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import pytest
import torch

from kernels import cpu_extension
from kernels.gguf_blocks_torch import SCALE_OFFSETS, dequantize_blocks, group_shape
from services.worker.fused_decode import FusedDecode, unsupported_reason
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.causal_lm import CausalLM
from services.worker.model.families import hf_family
from services.worker.quantization.gguf_linear import GGUFLinear
from tests.kernels.fused_decode_bounds import logits_bound, recorded_rows
from tests.kernels.test_llama_decode import (
    CONTEXT_LENS,
    assert_fused_matches_eager,
    decode_case,
    eager_then_fused,
    random_dense_model,
    random_model,
)
from tests.model.tiny_models import FAMILIES

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="no C++ CPU kernels")

VOCAB_SIZE = 96
# Below the longest context (13), so the windowed layers really cut contexts.
WINDOW = 6
Weights = Literal["gguf", "dense"]


def family_architecture(name: str) -> ModelArchitecture:
    """The tiny family's architecture as its reader sees the config.json transformers writes
    (a small vocabulary, and a window the test's contexts pass)."""
    import transformers

    spec = FAMILIES[name]
    settings = copy.deepcopy(spec.config)  # config classes edit rope_parameters in place
    if "sliding_window" in settings:
        settings["sliding_window"] = WINDOW
    config_class = getattr(transformers, spec.config_class)
    config = config_class(
        vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=None, pad_token_id=None, **settings
    ).to_dict()
    return hf_family(config).read_hf(config)


# The median row norm of every GGUF projection: a trained model's order (random_model's
# K-quant blocks reach row norms of 200, and attention scores of 1e4 then amplify a one-ulp
# difference ~300-fold in one layer, eager against itself).
GGUF_ROW_NORM = 2.0


def rescale_blocks(linear: GGUFLinear, row_norm: float) -> None:
    """Scales a GGUF projection's weights in place to a median row norm of `row_norm`, through
    the fp16 scales of its blocks (every value of a block is linear in them)."""
    weight = torch.cat(
        [dequantize_blocks(p, k) for p, k in zip(linear.parts, linear.kinds, strict=True)]
    )
    factor = row_norm / weight.norm(dim=-1).median().item()
    for part, kind in zip(linear.parts, linear.kinds, strict=True):
        blocks = part.view(part.shape[0], -1, group_shape(kind)[1])
        for offset in SCALE_OFFSETS[kind]:
            field = blocks[..., offset : offset + 2].contiguous().view(torch.float16)
            blocks[..., offset : offset + 2] = (field.float() * factor).half().view(torch.uint8)


def family_model(arch: ModelArchitecture, weights: Weights, seed: int) -> CausalLM:
    """Random weights; every norm the family has random too (post-norms and q/k norms
    included), so dropping one changes the step."""
    if weights == "gguf":
        model = random_model(arch, seed)
        for module in model.modules():
            if isinstance(module, GGUFLinear):
                rescale_blocks(module, GGUF_ROW_NORM)
    else:
        model = random_dense_model(arch, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in model.layers:
        norms = (
            layer.attn_out_norm,
            layer.mlp_out_norm,
            layer.self_attn.q_norm,
            layer.self_attn.k_norm,
        )
        for norm in norms:
            if norm is not None:
                norm.copy_(torch.rand(norm.shape, generator=g) + 0.5)
    return model


@pytest.mark.parametrize("weights", ["gguf", "dense"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_runs_fused_and_matches_its_eager_model(family: str, weights: Weights) -> None:
    arch = family_architecture(family)
    model = family_model(arch, weights, seed=31)
    case = decode_case(arch, torch.float32, seed=33)
    assert unsupported_reason(model, case.cache) is None
    fused = FusedDecode(model, case.cache)
    assert_fused_matches_eager(model, case, fused)
    assert fused.num_steps == 1  # the step ran fused, not through a fallback


def test_families_on_the_scalar_kernels(scalar_kernels: None) -> None:
    """The portable backend's GeGLU, on a model with every Gemma 2 switch (the scalar build's
    only code of its own in the step is the gating; the rest is shared C++)."""
    arch = family_architecture("gemma2")
    model = family_model(arch, "dense", seed=39)
    case = decode_case(arch, torch.float32, seed=41)
    assert_fused_matches_eager(model, case)


def _without_lists(**empty: list[int]) -> Callable[[FusedDecode], None]:
    def switch_off(fused: FusedDecode) -> None:
        fused._lists = replace(fused._lists, **empty)

    return switch_off


def _set(name: str, value: object) -> Callable[[FusedDecode], None]:
    def switch_off(fused: FusedDecode) -> None:
        setattr(fused, name, value)

    return switch_off


def _one_rope_everywhere(fused: FusedDecode) -> None:
    fused._lists = replace(fused._lists, layer_ropes=[0] * len(fused._lists.layer_ropes))


# (switch, a family that has it, the fused step with that switch off)
SWITCHES: list[tuple[str, str, Callable[[FusedDecode], None]]] = [
    ("post-norms", "gemma2", _without_lists(attn_out_norms=[], mlp_out_norms=[])),
    ("post-norms-only", "olmo2", _without_lists(attn_out_norms=[], mlp_out_norms=[])),
    ("gelu-tanh", "gemma", _set("hidden_act", "silu")),
    ("attention-soft-cap", "gemma2", _set("attn_logit_softcap", 0.0)),
    ("local-rope", "gemma3", _one_rope_everywhere),
    ("residual-multiplier", "granite", _set("residual_multiplier", 1.0)),
    ("layers-without-rope", "smollm3", _one_rope_everywhere),
    ("qk-norm-across-heads", "olmo2", _without_lists(q_norms=[], k_norms=[])),
]


@pytest.mark.parametrize(
    ("family", "switch_off"),
    [(family, switch_off) for _, family, switch_off in SWITCHES],
    ids=[name for name, _, _ in SWITCHES],
)
def test_each_switch_moves_the_step_past_the_bound(
    family: str, switch_off: Callable[[FusedDecode], None]
) -> None:
    """The bounds discriminate: the fused step without one of the family's switches lands
    outside them, so a step ignoring a switch would fail the tests above."""
    arch = family_architecture(family)
    model = family_model(arch, "gguf", seed=43)
    case = decode_case(arch, torch.float32, seed=45)
    fused = FusedDecode(model, case.cache)
    switch_off(fused)
    with recorded_rows(model) as rows:
        eager, without, _, _ = eager_then_fused(model, case, fused)
    # Not all within (a NaN, an overflow without OLMo 2's only norms, is outside too).
    assert not ((without - eager).abs() <= logits_bound(model, rows, eager)).all()
    assert fused.num_steps == 1
    assert without.shape == (len(CONTEXT_LENS), VOCAB_SIZE)


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_a_bf16_family_runs_fused_no_worse_than_eager_bf16(family: str) -> None:
    """bf16 weights: the fused step computes the layers in fp32 on them (eager bf16 rounds
    every op's output); held to the same weights in fp32, eager, no worse than eager bf16 on
    average, as the Llama bf16 test (test_llama_decode.py) holds it."""
    arch = family_architecture(family)
    bf16_model = family_model(arch, "dense", seed=47).to(torch.bfloat16)
    fp32_model = copy.deepcopy(bf16_model).float()
    bf16_case = decode_case(arch, torch.bfloat16, seed=49)
    fp32_case = decode_case(arch, torch.float32, seed=49)
    fp32_case.cache.storage.copy_(bf16_case.cache.storage.float())
    reference, _, _, _ = eager_then_fused(fp32_model, fp32_case)
    fused_decode = FusedDecode(bf16_model, bf16_case.cache)
    eager, fused, _, _ = eager_then_fused(bf16_model, bf16_case, fused_decode)
    assert fused_decode.num_steps == 1
    eager_error = (eager - reference).abs().amax(dim=-1)
    fused_error = (fused - reference).abs().amax(dim=-1)
    assert eager_error.mean() > 0  # bf16 really rounds
    assert fused_error.mean() <= 2 * eager_error.mean(), (fused_error, eager_error)


def test_the_ops_schema_and_shape_function() -> None:
    """The op's schema (the caches written in place) and its Meta kernel (what torch.compile
    traces with) agree with the CPU kernel, on a model with post-norms, QK-norm and two rope
    tables."""
    arch = family_architecture("gemma3")
    model = family_model(arch, "dense", seed=51)
    case = decode_case(arch, torch.float32, seed=53)
    fused = FusedDecode(model, case.cache)
    hidden = model.embed(case.batch.input_ids).float()
    torch.library.opcheck(
        torch.ops.llmserve.llama_decode_layers.default,
        fused.op_arguments(hidden, case.batch),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_bad_switches_raise_clear_errors() -> None:
    arch = family_architecture("gemma3")
    model = family_model(arch, "dense", seed=55)
    case = decode_case(arch, torch.float32, seed=57)
    fused = FusedDecode(model, case.cache)
    fused.hidden_act = "relu"
    with pytest.raises(RuntimeError, match="hidden_act must be silu or gelu_tanh"):
        fused.run(case.batch)
    fused = FusedDecode(model, case.cache)
    fused._lists = replace(fused._lists, layer_ropes=[2] * arch.num_layers)
    with pytest.raises(RuntimeError, match="layer_ropes names table 2 of 2"):
        fused.run(case.batch)
    fused = FusedDecode(model, case.cache)
    fused._lists = replace(fused._lists, mlp_out_norms=fused._lists.mlp_out_norms[:2])
    with pytest.raises(RuntimeError, match="mlp_out_norms has 2 tensors for 6 layers"):
        fused.run(case.batch)
