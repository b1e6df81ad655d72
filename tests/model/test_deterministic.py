"""--deterministic (batch-invariant mode) on the embedded model: a prompt's greedy tokens in
bf16 are the same alone and inside a batch of 16 concurrent requests of mixed lengths (mixed
greedy and sampled, arriving before it, its prompt chunked differently, part of it served
from the prefix cache); and in fp32 the mode still gives Hugging Face's greedy tokens. The
default mode is batch-invariant too on a GGUF model (int8 activations): every step, prefill
included, runs the fused C++ layers, and the same holds there."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.lora_adapters import write_random_adapter
from services.common.model_source import embedded_model_path
from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from services.worker.quantization.gguf_linear import GGUFLinear
from tests.model.conftest import PROMPTS

PROBE = (
    "Write a short story about a robot who learns to paint. The robot lives in a small town "
    "by the sea, and every morning it"
)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def deterministic_bf16() -> LLMEngine:
    # A model of its own: the mode switches the layers of the model it is given.
    loaded = LoadedModel.load(None, torch.bfloat16, "cpu", "auto")
    config = EngineConfig(
        dtype="bfloat16",
        kv_cache_gib=256 / 1024,
        deterministic=True,
        # A small step budget, so the probe's prompt is chunked differently in a busy batch.
        max_num_batched_tokens=96,
    )
    return LLMEngine(config, loaded=loaded)


def run_alone(engine: LLMEngine, prompt: list[int], lora_name: str = "") -> list[int]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    probe_id = engine.add_request(prompt, greedy, lora_name=lora_name)
    return [t for e in engine.stream() if e.request_id == probe_id for t in e.new_token_ids]


def run_counting_steps(
    engine: LLMEngine, prompt: list[int], lora_name: str = ""
) -> tuple[list[int], int]:
    """The probe alone: its tokens and the forward steps it took (the engine's last step,
    which only retires it, not counted)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    probe_id = engine.add_request(prompt, greedy, lora_name=lora_name)
    tokens: list[int] = []
    num_steps = 0
    while len(tokens) < NEW_TOKENS:
        num_steps += 1
        tokens += [t for e in engine.step() if e.request_id == probe_id for t in e.new_token_ids]
    for _ in engine.stream():
        pass
    return tokens, num_steps


def run_in_batch(
    engine: LLMEngine, prompt: list[int], seed: int, steps_before: int, lora_name: str = ""
) -> list[int]:
    """The probe joins 16 running requests (prompts of 4..160 tokens, half greedy, half
    sampled, one sharing its first tokens; with `lora_name`, every third on the adapter too)
    after `steps_before` steps."""
    rng = random.Random(seed)
    for i in range(15):
        length = rng.randint(4, 160)
        ids = [rng.randint(100, 40000) for _ in range(length)]
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            max_new_tokens=rng.randint(8, 48),
            ignore_eos=True,
            seed=i,
        )
        engine.add_request(ids, params, lora_name=lora_name if i % 3 == 0 else "")
    shared = prompt[:-3] + [rng.randint(100, 40000) for _ in range(20)]
    engine.add_request(
        shared, SamplingParams(temperature=0.0, max_new_tokens=30), lora_name=lora_name
    )
    for _ in range(steps_before):
        engine.step()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    probe_id = engine.add_request(prompt, greedy, lora_name=lora_name)
    tokens: list[int] = []
    for event in engine.stream():
        if event.request_id == probe_id:
            tokens.extend(event.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def default_engine() -> LLMEngine:
    """The engine as `llmserve up` configures it (deterministic unset), a small step budget."""
    config = EngineConfig(kv_cache_gib=256 / 1024, max_num_batched_tokens=96)
    return LLMEngine(config, loaded=LoadedModel.load(None, torch.float32, "cpu", "auto"))


def test_the_mode_switches_every_linear_layer(deterministic_bf16: LLMEngine) -> None:
    linears = [m for m in deterministic_bf16.model.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.batch_invariant for m in linears)
    runner = deterministic_bf16.runner
    # GGUF blocks with int8 activations: the fused layers serve every step.
    assert runner.fused_decode is not None and runner.decode_graphs is None


def test_the_default_is_batch_invariant_on_gguf(default_engine: LLMEngine) -> None:
    runner = default_engine.runner
    assert runner.batch_invariant and runner.fused_decode is not None
    before = runner.fused_decode.num_steps
    _, num_steps = run_counting_steps(default_engine, default_engine.tokenizer.encode(PROBE))
    # The prefill step and every decode step (fewer than the tokens where drafts pass), fused.
    assert runner.fused_decode.num_steps - before == num_steps


def test_default_greedy_is_the_same_alone_repeated_and_in_a_busy_batch(
    default_engine: LLMEngine,
) -> None:
    engine = default_engine
    prompt = engine.tokenizer.encode(PROBE)
    alone = run_alone(engine, prompt)
    assert len(alone) == NEW_TOKENS
    assert run_alone(engine, prompt) == alone  # from the prefix cache
    for trial, steps_before in enumerate([0, 3]):
        assert run_in_batch(engine, prompt, seed=trial, steps_before=steps_before) == alone
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    """The default engine with one random adapter (every projection, rank 8)."""
    adapter = write_random_adapter(
        tmp_path_factory.mktemp("adapter"), embedded_model_path(), rank=8, seed=5, b_scale=0.05
    )
    config = EngineConfig(
        kv_cache_gib=256 / 1024, max_num_batched_tokens=96, lora_modules=(f"probe={adapter}",)
    )
    return LLMEngine(config, loaded=LoadedModel.load(None, torch.float32, "cpu", "auto"))


def test_default_greedy_with_an_adapter_is_the_same_alone_repeated_and_in_a_busy_batch(
    lora_engine: LLMEngine,
) -> None:
    """Steps with adapter rows, prefill ones included, run the fused layers too (each row's
    delta is added by the same kernel whatever the segment around it), so a request on an
    adapter keeps its greedy tokens among other adapters' and the base's rows."""
    engine = lora_engine
    runner = engine.runner
    assert runner.batch_invariant and runner.fused_decode is not None
    prompt = engine.tokenizer.encode(PROBE)
    before = runner.fused_decode.num_steps
    alone, num_steps = run_counting_steps(engine, prompt, lora_name="probe")
    assert len(alone) == NEW_TOKENS
    assert runner.fused_decode.num_steps - before == num_steps  # the prefill step too
    assert alone != run_alone(engine, prompt)  # the adapter changes the answer
    assert run_alone(engine, prompt, lora_name="probe") == alone  # from the prefix cache
    for trial, steps_before in enumerate([0, 3]):
        in_batch = run_in_batch(engine, prompt, trial, steps_before, lora_name="probe")
        assert in_batch == alone, f"trial {trial}"
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks


def test_greedy_bf16_is_the_same_alone_and_in_a_busy_batch(deterministic_bf16: LLMEngine) -> None:
    engine = deterministic_bf16
    prompt = engine.tokenizer.encode(PROBE)
    alone = run_alone(engine, prompt)
    assert len(alone) == NEW_TOKENS
    for trial, steps_before in enumerate([0, 3]):
        in_batch = run_in_batch(engine, prompt, seed=trial, steps_before=steps_before)
        first = next(
            (i for i, (a, b) in enumerate(zip(in_batch, alone, strict=False)) if a != b),
            min(len(in_batch), len(alone)),
        )
        assert in_batch == alone, f"trial {trial}: first difference at token {first}"
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks


def test_fp32_deterministic_greedy_matches_hf(hf_model) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(
        EngineConfig(dtype="float32", kv_cache_gib=256 / 1024, deterministic=True),
        loaded=LoadedModel.load(None, torch.float32),
    )
    hf_model.generation_config.eos_token_id = None
    prompt_ids = [engine.tokenizer.encode(text) for text in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    results = engine.generate(prompt_ids, greedy)
    for ids, result in zip(prompt_ids, results, strict=True):
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0
            )
        assert result.token_ids == out[0, len(ids) :].tolist(), engine.tokenizer.decode(ids)
