"""The fused decode op (kernels/csrc/llama_decode.cpp) against the eager model it replaces:
a small random Llama with GGUF-block projections of every kind, a paged KV cache of random
contents (float and int8), ragged contexts, per-layer sliding windows, partial rotary and rows
of LoRA adapters. Its reference is `CausalLM.forward`, the same layer code every other path
runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from kernels import cpu_extension
from kernels.gguf_blocks_torch import GGUF_KINDS, group_shape
from services.worker.forward_batch import ForwardBatch
from services.worker.fused_decode import FusedDecode, unsupported_reason
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.lora.batch import LoraBatch, lora_batch
from services.worker.lora.slots import LoraSlots
from services.worker.model.architecture import ModelArchitecture, QKNorm, RopeConfig
from services.worker.model.causal_lm import CausalLM, DecoderLayer
from services.worker.quantization.gguf_linear import GGUFLinear
from tests.kernels.fused_decode_bounds import (
    assert_kv_within_bounds,
    assert_logits_within_bounds,
    recorded_rows,
)
from tests.kernels.test_gguf_gemm import random_blocks

BLOCK_SIZE = 4
NUM_BLOCKS = 48
CONTEXT_LENS = [5, 13, 1, 8]

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="no C++ CPU kernels")


def tiny_config(attention_bias: bool) -> ModelArchitecture:
    return ModelArchitecture(
        family="llama",
        vocab_size=96,
        hidden_size=256,
        intermediate_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=attention_bias,
    )


# Each projection's parts: one kind, or (a Q4_K_M file's q|k|v, say) parts of different kinds.
PART_PLANS = [
    ["Q4_0"],
    ["Q4_K"],
    ["Q5_0", "Q8_0", "Q6_K"],
    ["Q4_1"],
    ["Q5_K"],
    ["IQ4_NL"],
    ["Q3_K"],
    ["Q5_1"],
    ["Q2_K", "IQ4_XS"],
    ["Q8_0"],
    ["Q6_K"],
]


def random_projection(
    out_features: int,
    in_features: int,
    plan: list[str],
    seed: int,
    bias: torch.Tensor | None,
    int8_activations: bool,
) -> GGUFLinear:
    """GGUF blocks of the plan's kinds (32-value kinds where K is no multiple of 256), the
    rows split evenly between its parts."""
    kinds = [GGUF_KINDS[name] for name in plan]
    if any(in_features % group_shape(kind)[0] for kind in kinds):
        kinds = [GGUF_KINDS["Q5_0"], GGUF_KINDS["Q4_1"]][: len(kinds)]
    rows = [out_features // len(kinds)] * len(kinds)
    rows[-1] += out_features - sum(rows)
    parts = [
        random_blocks(n, in_features, kind, seed + i)
        for i, (n, kind) in enumerate(zip(rows, kinds, strict=True))
    ]
    return GGUFLinear(parts, kinds, bias, int8_activations=int8_activations)


def randomize_pre_norms(layer: DecoderLayer) -> None:
    """The norms before attention and the MLP, where the model has them (not OLMo 2)."""
    for norm in (layer.attn_norm, layer.mlp_norm):
        if norm is not None:
            norm.uniform_(0.5, 1.5)


def random_model(config: ModelArchitecture, seed: int, int8_activations: bool = False) -> CausalLM:
    """Random norms and embedding; every projection GGUF blocks, every kind somewhere."""
    torch.manual_seed(seed)
    model = CausalLM(config)
    model.embed_tokens.weight.normal_()
    model.lm_head.weight.normal_(std=0.1)
    for index, layer in enumerate(model.layers):
        randomize_pre_norms(layer)
        attn, mlp = layer.self_attn, layer.mlp
        for offset, (owner, name) in enumerate(
            [(attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]
        ):
            dense = getattr(owner, name)
            plan = PART_PLANS[(4 * index + offset) % len(PART_PLANS)]
            bias = None if dense.bias is None else torch.randn(dense.out_features) * 0.1
            projection = random_projection(
                dense.out_features, dense.in_features, plan, seed + offset, bias, int8_activations
            )
            setattr(owner, name, projection)
    return model


@dataclass
class DecodeCase:
    batch: ForwardBatch
    cache: PagedKVCache


def decode_case(config: ModelArchitecture, kv_dtype: torch.dtype, seed: int) -> DecodeCase:
    """Sequences at CONTEXT_LENS, each on its own shuffled blocks, caches full of noise."""
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec.for_model(config, BLOCK_SIZE, kv_dtype, quant_group_size=8)
    cache = PagedKVCache(spec, NUM_BLOCKS, "cpu")
    if kv_dtype == torch.int8:
        cache.storage.copy_(torch.randint(-127, 128, cache.storage.shape, generator=g))
        assert cache.scales is not None
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) * 0.02)
    else:
        cache.storage.copy_(torch.randn(cache.storage.shape, generator=g))
    width = max(-(-n // BLOCK_SIZE) for n in CONTEXT_LENS) + 1
    order = torch.randperm(NUM_BLOCKS, generator=g)
    tables = order[: len(CONTEXT_LENS) * width].view(len(CONTEXT_LENS), width).to(torch.int32)
    positions = torch.tensor([n - 1 for n in CONTEXT_LENS])
    slots = torch.stack(
        [
            tables[i, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
            for i, p in enumerate(positions.tolist())
        ]
    )
    batch = ForwardBatch.for_decode(
        torch.randint(0, config.vocab_size, (len(CONTEXT_LENS),), generator=g),
        positions,
        slots,
        tables,
        torch.tensor(CONTEXT_LENS, dtype=torch.int32),
    )
    return DecodeCase(batch, cache)


def eager_then_fused(
    model: CausalLM, case: DecodeCase, fused: FusedDecode | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(eager logits, fused logits, the cache after eager, the cache after fused)."""
    before = case.cache.storage.clone()
    scales_before = None if case.cache.scales is None else case.cache.scales.clone()
    with torch.inference_mode():
        eager = model(case.batch, case.cache.layers)
        after_eager = case.cache.storage.clone()
        case.cache.storage.copy_(before)
        if scales_before is not None:
            assert case.cache.scales is not None
            case.cache.scales.copy_(scales_before)
        fused_logits = (fused or FusedDecode(model, case.cache)).run(case.batch)
    return eager, fused_logits, after_eager, case.cache.storage


def with_switches(
    config: ModelArchitecture,
    windows: tuple[int, ...] = (),
    rotary_dim: int = 16,
    qk_norm: QKNorm = "none",
) -> ModelArchitecture:
    """The config with per-layer windows, a partial rotary and QK-norm as the model reads them."""
    rope = RopeConfig(partial_rotary_factor=rotary_dim / config.head_dim)
    return replace(config, layer_sliding_windows=windows, rope=rope, qk_norm=qk_norm)


def assert_fused_matches_eager(
    model: CausalLM, case: DecodeCase, fused_decode: FusedDecode | None = None
) -> torch.Tensor:
    """Fused logits and the keys and values the step writes within the bounds
    tests/kernels/fused_decode_bounds.py derives from eager's; returns the eager logits."""
    before = case.cache.storage.clone()
    with recorded_rows(model) as rows:
        eager, fused, after_eager, after_fused = eager_then_fused(model, case, fused_decode)
    assert_logits_within_bounds(model, rows, eager, fused)
    assert_kv_within_bounds(
        model, case.batch, rows, before, after_eager, after_fused, case.cache.scales
    )
    return eager


# Layer 0 windowed inside a block of 4, layer 1 full, layer 2 across block boundaries; the
# contexts (5, 13, 1, 8) are cut by both windows but the shortest.
LAYER_WINDOWS = (3, 0, 6)


@pytest.mark.parametrize("windows", [(), LAYER_WINDOWS], ids=["no-window", "windows"])
@pytest.mark.parametrize("rotary_dim", [16, 12, 4], ids=["full-rope", "rope-12", "rope-4"])
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, torch.int8], ids=["fp32-kv", "fp16-kv", "int8-kv"]
)
def test_fused_step_windows_and_partial_rotary(
    windows: tuple[int, ...], rotary_dim: int, kv_dtype: torch.dtype
) -> None:
    config = with_switches(tiny_config(attention_bias=True), windows, rotary_dim)
    model = random_model(config, seed=7)
    case = decode_case(config, kv_dtype, seed=9)
    eager = assert_fused_matches_eager(model, case)
    if windows or rotary_dim != 16:
        # The features change the logits: a fused step ignoring them would fail above.
        plain = random_model(tiny_config(attention_bias=True), seed=7)
        plain_logits, _, _, _ = eager_then_fused(plain, decode_case(config, kv_dtype, seed=9))
        assert (plain_logits - eager).abs().max() > 1e-2


def test_fused_step_rejects_a_window_list_of_the_wrong_length() -> None:
    config = tiny_config(attention_bias=False)
    model = random_model(config, seed=2)
    case = decode_case(config, torch.float32, seed=2)
    fused = FusedDecode(model, case.cache)
    fused.sliding_windows = [4, 0]
    with pytest.raises(RuntimeError, match="one window per layer"):
        fused.run(case.batch)


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, torch.int8], ids=["fp32-kv", "fp16-kv", "int8-kv"]
)
def test_fused_step_matches_the_eager_model(attention_bias: bool, kv_dtype: torch.dtype) -> None:
    config = tiny_config(attention_bias)
    model = random_model(config, seed=3)
    case = decode_case(config, kv_dtype, seed=5)
    before = case.cache.storage.clone()
    with recorded_rows(model) as rows:
        eager, fused, after_eager, after_fused = eager_then_fused(model, case)
    assert fused.shape == eager.shape == (len(CONTEXT_LENS), config.vocab_size)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    # The step's keys and values land in the same slots, with the same values up to the
    # bound of the two paths' roundings (on AVX-512 a key that cancels to -1.12 in a row
    # reaching 990 was 2.5e-4 apart: no bound relative to the value itself holds there).
    assert_kv_within_bounds(
        model, case.batch, rows, before, after_eager, after_fused, case.cache.scales
    )
    assert not torch.equal(after_eager, before)


def test_int8_activations_follow_the_layers_setting() -> None:
    """With int8 activation blocks the fused step computes what the eager layers compute: the
    same rounding (only an activation sitting on a rounding boundary may round the other way,
    so the check is loose), and measurably not the exact product."""
    config = tiny_config(attention_bias=False)
    exact = random_model(config, seed=11)
    rounded = random_model(config, seed=11, int8_activations=True)
    case = decode_case(config, torch.float32, seed=13)
    eager_rounded, fused_rounded, _, _ = eager_then_fused(rounded, case)
    case = decode_case(config, torch.float32, seed=13)
    eager_exact, _, _, _ = eager_then_fused(exact, case)
    gap = (eager_rounded - eager_exact).abs().max().item()
    assert gap > 1e-3  # the rounding is really on
    assert (fused_rounded - eager_rounded).abs().max().item() < 0.1 * gap + 1e-4


def test_models_the_fused_step_cannot_run_say_why() -> None:
    config = tiny_config(attention_bias=False)
    model = random_dense_model(config, seed=1)
    spec = KVCacheSpec.for_model(config, BLOCK_SIZE, torch.float32)
    cache = PagedKVCache(spec, NUM_BLOCKS, "cpu")
    assert unsupported_reason(model, cache) is None
    down = model.layers[1].mlp.down_proj
    model.layers[1].mlp.down_proj = nn.Linear(
        down.in_features, down.out_features, bias=False, dtype=torch.float64
    )
    reason = "neither GGUF blocks nor a dense float weight"
    assert reason in (unsupported_reason(model, cache) or "")
    with pytest.raises(ValueError, match=reason):
        FusedDecode(model, cache)
    assert unsupported_reason(random_model(config, seed=1), cache) is None


def random_dense_model(config: ModelArchitecture, seed: int) -> CausalLM:
    """Random norms, embedding and dense projections (nn.Linear, as a safetensors model)."""
    torch.manual_seed(seed)
    model = CausalLM(config)
    model.embed_tokens.weight.normal_()
    model.lm_head.weight.normal_(std=0.1)
    for layer in model.layers:
        randomize_pre_norms(layer)
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            linear.weight.normal_(std=0.2)
        for linear in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.weight.normal_(std=0.1)
        if layer.self_attn.qkv_proj.bias is not None:
            layer.self_attn.qkv_proj.bias.normal_(std=0.1)
    return model


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32-kv", "int8-kv"])
def test_a_dense_float32_model_runs_fused(kv_dtype: torch.dtype) -> None:
    """nn.Linear projections go through the same product the eager layer computes (one
    dense part of ggml kind F32), so only the C++ elementwise ops' summation order differs."""
    config = tiny_config(attention_bias=True)
    model = random_dense_model(config, seed=8)
    assert_fused_matches_eager(model, decode_case(config, kv_dtype, seed=9))


def test_a_dense_bf16_model_runs_fused_no_worse_than_eager_bf16() -> None:
    """bf16 weights: each product rounds its input and output to bf16 as the eager layer
    does, the rest stays fp32. Reference: the same bf16 weights in fp32, eager; the fused
    step's error is held to eager bf16's on average (both round the step's key, value and
    query to the bf16 cache)."""
    config = tiny_config(attention_bias=True)
    bf16_model = random_dense_model(config, seed=10).to(torch.bfloat16)
    fp32_model = copy.deepcopy(bf16_model).float()
    bf16_case = decode_case(config, torch.bfloat16, seed=12)
    fp32_case = decode_case(config, torch.float32, seed=12)
    fp32_case.cache.storage.copy_(bf16_case.cache.storage.float())
    reference, _, _, _ = eager_then_fused(fp32_model, fp32_case)
    eager, fused, _, _ = eager_then_fused(bf16_model, bf16_case)
    eager_error = (eager - reference).abs().amax(dim=-1)
    fused_error = (fused - reference).abs().amax(dim=-1)
    assert eager_error.mean() > 0  # bf16 really rounds
    assert fused_error.mean() <= 2 * eager_error.mean(), (fused_error, eager_error)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
def test_a_bf16_model_runs_fused_in_fp32_between_its_embedding_and_head(
    kv_dtype: torch.dtype,
) -> None:
    """A bf16 model needs no compiled graphs either: the fused step computes its layers in
    fp32 on the model's bf16 weights (the eager layers round every op's output to bf16) and
    reads a bf16 cache with a bf16 query. Reference: those bf16 weights in fp32, eager, on the
    same cache contents. With an int8 cache only the activations' int8 rounding differs
    (measured <= 0.025 on logits of ~5; eager bf16 is off by up to 0.33); a bf16 cache also
    rounds the step's own key, value and query to bf16, as eager bf16 does, so there the
    fused error is held to eager bf16's on average (per-row maxima of a random model with
    int8 activations scatter)."""
    config = tiny_config(attention_bias=True)
    bf16_model = random_model(config, seed=4, int8_activations=True).to(torch.bfloat16)
    fp32_model = copy.deepcopy(bf16_model).float()
    bf16_cache = PagedKVCache(KVCacheSpec.for_model(config, BLOCK_SIZE, torch.bfloat16), 1, "cpu")
    assert unsupported_reason(bf16_model, bf16_cache) is None
    bf16_case = decode_case(config, kv_dtype, seed=6)
    fp32_case = decode_case(config, kv_dtype if kv_dtype == torch.int8 else torch.float32, 6)
    if kv_dtype != torch.int8:
        fp32_case.cache.storage.copy_(bf16_case.cache.storage.float())
    reference, _, _, _ = eager_then_fused(fp32_model, fp32_case)
    eager, fused, after_eager, after_fused = eager_then_fused(bf16_model, bf16_case)
    assert fused.dtype == eager.dtype == torch.float32
    eager_error = (eager - reference).abs().amax(dim=-1)
    fused_error = (fused - reference).abs().amax(dim=-1)
    if kv_dtype == torch.int8:
        assert fused_error.max() < 0.05, fused_error
    else:
        assert fused_error.mean() <= 2 * eager_error.mean(), (fused_error, eager_error)
    # The same slots written (their values follow the two paths' different roundings).
    before = decode_case(config, kv_dtype, seed=6).cache.storage
    written = [(after != before).flatten(3).any(-1) for after in (after_eager, after_fused)]
    assert torch.equal(written[0], written[1]) and written[0].any()


def test_bad_arguments_raise_clear_errors() -> None:
    config = tiny_config(attention_bias=False)
    model = random_model(config, seed=2)
    case = decode_case(config, torch.float32, seed=2)
    fused = FusedDecode(model, case.cache)
    bad = ForwardBatch.for_decode(
        case.batch.input_ids,
        torch.full_like(case.batch.positions, 10_000),
        case.batch.slot_mapping,
        case.batch.decode_block_tables,
        case.batch.decode_context_lens,
    )
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        fused.run(bad)


def test_a_dense_part_of_the_wrong_dtype_is_refused() -> None:
    """A dense part's kind names its weight's dtype; a float32 weight labelled BF16 (30) is
    refused before any product runs."""
    config = tiny_config(attention_bias=False)
    model = random_dense_model(config, seed=2)
    case = decode_case(config, torch.float32, seed=2)
    fused = FusedDecode(model, case.cache)
    fused._lists.kinds[0] = 30
    with pytest.raises(RuntimeError, match="a dense projection is one \\[N, K\\] weight"):
        fused.run(case.batch)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32-kv", "int8-kv"])
def test_fused_step_normalizes_q_and_k_heads(kv_dtype: torch.dtype) -> None:
    """A model with per-head QK-norm (Qwen3) runs fused and matches its eager layers (here
    with windows and partial rotary too)."""
    config = with_switches(tiny_config(attention_bias=True), LAYER_WINDOWS, 12, "per_head")
    model = random_model(config, seed=17)
    g = torch.Generator().manual_seed(19)
    for layer in model.layers:
        attention = layer.self_attn
        assert attention.q_norm is not None and attention.k_norm is not None
        attention.q_norm.copy_(torch.rand(config.head_dim, generator=g) + 0.5)
        attention.k_norm.copy_(torch.rand(config.head_dim, generator=g) + 0.5)
    case = decode_case(config, kv_dtype, seed=21)
    fused = FusedDecode(model, case.cache)
    assert len(fused._lists.q_norms) == len(model.layers)
    before = case.cache.storage.clone()
    with recorded_rows(model) as rows:
        eager, fused_logits, after_eager, after_fused = eager_then_fused(model, case, fused)
    torch.testing.assert_close(fused_logits, eager, rtol=1e-4, atol=1e-4)
    assert_kv_within_bounds(
        model, case.batch, rows, before, after_eager, after_fused, case.cache.scales
    )
    without = FusedDecode(model, case.cache)
    without._lists = replace(without._lists, q_norms=[], k_norms=[])
    _, without_norms, _, _ = eager_then_fused(
        model, decode_case(config, kv_dtype, seed=21), without
    )
    assert (without_norms - eager).abs().max() > 1e-2


def test_fused_step_checks_the_head_norms() -> None:
    config = tiny_config(attention_bias=False)
    model = random_model(config, seed=2)
    case = decode_case(config, torch.float32, seed=2)
    fused = FusedDecode(model, case.cache)
    fused._lists = replace(fused._lists, q_norms=[torch.ones(16)] * 3, k_norms=[])
    with pytest.raises(RuntimeError, match="q_norms and k_norms"):
        fused.run(case.batch)
    fused._lists = replace(fused._lists, k_norms=[torch.ones(8)] * 3)
    with pytest.raises(RuntimeError, match="k_norms must be fp32 \\[16\\]"):
        fused.run(case.batch)


# --- LoRA rows ---------------------------------------------------------------------------------

# The decode case's four rows: an adapter, the base model, another adapter, the first again.
LORA_ROW_SLOTS = [2, -1, 0, 2]


def random_lora_batch(
    config: ModelArchitecture, dtype: torch.dtype, seed: int, max_rank: int = 8
) -> LoraBatch:
    """Three slots of random A, B and scales (slot 1 unused by the rows) over every layer and
    projection, and the segment table of LORA_ROW_SLOTS."""
    slots = LoraSlots(config, num_slots=3, max_rank=max_rank, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(seed)
    for tables in (slots.lora_a, slots.lora_b):
        for table in tables.values():
            table.copy_(torch.randn(table.shape, generator=g) * 0.1)
    slots.scales.copy_(torch.tensor([0.5, 2.0, 1.5]))
    return lora_batch([(1, slot) for slot in LORA_ROW_SLOTS], slots, torch.device("cpu"))


@pytest.mark.parametrize("dense", [False, True], ids=["gguf", "dense"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32-kv", "int8-kv"])
def test_fused_step_adds_each_rows_adapter(dense: bool, kv_dtype: torch.dtype) -> None:
    """LoRA tables on a fused step: each row gets its own adapter's delta after the four
    projections as the eager layers add it (the same kernel), the base row none."""
    config = tiny_config(attention_bias=True)
    model = random_dense_model(config, seed=23) if dense else random_model(config, seed=23)
    case = decode_case(config, kv_dtype, seed=25)
    plain_eager, plain_fused, _, _ = eager_then_fused(model, case)
    case = decode_case(config, kv_dtype, seed=25)
    case.batch.lora = random_lora_batch(config, torch.float32, seed=27)
    eager = assert_fused_matches_eager(model, case)
    # The adapters move the logits of their rows; the base row's are those of a step
    # without adapters, bit for bit on the fused path.
    moved = (eager - plain_eager).abs().amax(dim=-1)
    assert all(moved[row] > 1e-2 for row, slot in enumerate(LORA_ROW_SLOTS) if slot >= 0), moved
    case = decode_case(config, kv_dtype, seed=25)
    case.batch.lora = random_lora_batch(config, torch.float32, seed=27)
    _, fused, _, _ = eager_then_fused(model, case)
    base_row = LORA_ROW_SLOTS.index(-1)
    assert torch.equal(fused[base_row], plain_fused[base_row])


def test_a_bf16_models_adapters_round_as_its_eager_layers() -> None:
    """bf16 tables (a bf16 model's slots): each projection of an adapter row rounds to bf16
    with its delta, as the eager bf16 layer does; held to eager bf16 as the plain bf16 step
    is (the error against the same weights in fp32, on average)."""
    config = tiny_config(attention_bias=True)
    bf16_model = random_dense_model(config, seed=29).to(torch.bfloat16)
    fp32_model = copy.deepcopy(bf16_model).float()
    lora = random_lora_batch(config, torch.bfloat16, seed=31)
    fp32_lora = random_lora_batch(config, torch.float32, seed=31)
    for projection in fp32_lora.slots.lora_a:
        fp32_lora.slots.lora_a[projection].copy_(lora.slots.lora_a[projection])
        fp32_lora.slots.lora_b[projection].copy_(lora.slots.lora_b[projection])
    bf16_case = decode_case(config, torch.bfloat16, seed=33)
    fp32_case = decode_case(config, torch.float32, seed=33)
    fp32_case.cache.storage.copy_(bf16_case.cache.storage.float())
    bf16_case.batch.lora, fp32_case.batch.lora = lora, fp32_lora
    reference, _, _, _ = eager_then_fused(fp32_model, fp32_case)
    eager, fused, _, _ = eager_then_fused(bf16_model, bf16_case)
    eager_error = (eager - reference).abs().amax(dim=-1)
    fused_error = (fused - reference).abs().amax(dim=-1)
    assert eager_error.mean() > 0
    assert fused_error.mean() <= 2 * eager_error.mean(), (fused_error, eager_error)


def test_fused_step_checks_the_lora_tables() -> None:
    config = tiny_config(attention_bias=False)
    model = random_model(config, seed=2)
    case = decode_case(config, torch.float32, seed=2)
    lora = random_lora_batch(config, torch.float32, seed=3)
    fused = FusedDecode(model, case.cache)
    case.batch.lora = lora
    lora.slots.lora_a["o"] = lora.slots.lora_a["o"][:2]  # two layers of three
    with pytest.raises(RuntimeError, match="a LoRA table must be \\[3 layers"):
        fused.run(case.batch)
    case.batch.lora = random_lora_batch(config, torch.float32, seed=3)
    case.batch.lora.seg_starts[-1] = 9
    with pytest.raises(RuntimeError, match="within the batch of 4"):
        fused.run(case.batch)
