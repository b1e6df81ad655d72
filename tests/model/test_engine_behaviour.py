"""Engine behaviour on the real embedded model: continuous batching, prefix cache and
preemption never change greedy output; bad input raises a typed error naming the field."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.contracts.errors import InvalidRequestError
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, FinishReason, StepResult
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from tests.model.conftest import FP32, PROMPTS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def make_engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    return LLMEngine(replace(FP32, **overrides), loaded=loaded)  # type: ignore[arg-type]


def run_alone(loaded: LoadedModel, prompt: list[int], sampling: SamplingParams) -> list[int]:
    engine = make_engine(loaded, enable_prefix_caching=False)
    return engine.generate([prompt], sampling)[0].token_ids


def mixed_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    """Prompts of varied lengths (5 to ~200 tokens) built from the shared prompt list."""
    base = [engine.tokenizer.encode(text) for text in PROMPTS]
    prompts = []
    for index in range(count):
        ids = base[index % len(base)]
        repeat = 1 + (index * 5) % 17
        prompts.append((ids * repeat)[: 8 + index * 13])
    return prompts


def test_batch_invariance_with_staggered_arrivals(loaded_fp32: LoadedModel) -> None:
    # A small step budget forces chunked prefill to share steps with running decodes.
    engine = make_engine(loaded_fp32, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompts = mixed_prompts(engine, 16)
    lengths = [8 + (i * 7) % 20 for i in range(16)]
    sampling = [replace(GREEDY, max_new_tokens=n) for n in lengths]
    outputs: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(zip(prompts, sampling, strict=True))
    max_batch_seen = 0
    while pending or engine.has_unfinished_requests():
        # Two new arrivals every step while any are left.
        for prompt, params in pending[:2]:
            ids.append(engine.add_request(prompt, params))
        pending = pending[2:]
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
        max_batch_seen = max(max_batch_seen, engine.get_stats().num_running)
    assert max_batch_seen >= 8, "the workload never actually batched"
    for request_id, prompt, params in zip(ids, prompts, sampling, strict=True):
        assert outputs[request_id] == run_alone(loaded_fp32, prompt, params), request_id


def test_prefix_cache_reuses_blocks_with_identical_output(loaded_fp32: LoadedModel) -> None:
    engine = make_engine(loaded_fp32)
    shared = (engine.tokenizer.encode(" ".join(PROMPTS)) * 3)[:150]
    first = shared + engine.tokenizer.encode(" Question one?")
    second = shared + engine.tokenizer.encode(" A different question?")
    engine.generate([first], GREEDY)
    before = engine.get_stats()
    result = engine.generate([second], GREEDY)[0]
    after = engine.get_stats()
    block_size = engine.kv_cache.spec.block_size
    expected_hit = (len(shared) // block_size) * block_size
    assert result.usage.cached_prompt_tokens == expected_hit
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == expected_hit
    assert result.token_ids == run_alone(loaded_fp32, second, GREEDY)


def test_a_prefix_hit_over_a_float16_cache_keeps_greedy_output() -> None:
    """The default GGUF arithmetic (int8 activations, a float16 cache under a float32 model):
    a prompt whose system part another request cached, and the same prompt cached whole,
    give the tokens a cold cache gives. Attention over a fresh chunk sees its keys and values
    as the cache holds them; before, the fresh chunk's float32 values and the cached float16
    ones differed enough to turn token 5 of this prompt into another one."""
    import torch

    from services.text.chat_template import ChatMessage

    loaded = LoadedModel.load(None, torch.float32, quantization="gguf")
    sampling = replace(GREEDY, max_new_tokens=8)

    def chat(text: str, engine: LLMEngine) -> list[int]:
        return engine.tokenizer.apply_chat_template([ChatMessage("user", text)])

    text = (
        "Repeat exactly: the mill by the river was rebuilt three times in a hundred years, and "
        "the mill by the river still grinds rye and barley for the bakery."
    )
    cold_engine = make_engine(loaded, enable_prefix_caching=False, dtype="float32")
    assert cold_engine.kv_cache.spec.dtype == torch.float16
    cold = cold_engine.generate([chat(text, cold_engine)], sampling)[0].token_ids
    engine = make_engine(loaded)
    engine.generate([chat("Write a haiku about the sea.", engine)], sampling)
    partial = engine.generate([chat(text, engine)], sampling)[0]
    whole = engine.generate([chat(text, engine)], sampling)[0]
    assert 0 < partial.usage.cached_prompt_tokens < whole.usage.cached_prompt_tokens
    assert partial.token_ids == whole.token_ids == cold


def test_preemption_by_recompute_keeps_greedy_output(loaded_fp32: LoadedModel) -> None:
    spec_bytes = LLMEngine(FP32, loaded=loaded_fp32).kv_cache.spec.bytes_per_block
    # 16 blocks of 16 tokens; the 6 sequences need 23 at their longest: decodes must preempt.
    engine = make_engine(
        loaded_fp32, kv_cache_gib=16 * spec_bytes / 2**30, enable_prefix_caching=False
    )
    prompts = [p[:30] for p in mixed_prompts(engine, 6)]
    sampling = replace(GREEDY, max_new_tokens=32)
    results = engine.generate(prompts, sampling)
    assert engine.get_stats().num_preemptions > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_reason is FinishReason.LENGTH
        assert result.token_ids == run_alone(loaded_fp32, prompt, sampling)
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 9000, SamplingParams(), "prompt"),
        ([1, 2, 3], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1, 2, 3], SamplingParams(max_new_tokens=-5), "max_new_tokens"),
        ([1, 2, 3], SamplingParams(max_new_tokens=10**9), "max_new_tokens"),
        ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(temperature=-0.1), "temperature"),
        ([1, 2, 3], SamplingParams(temperature=math.nan), "temperature"),
        ([1, 2, 3], SamplingParams(top_k=-2), "top_k"),
        ([1, 2, 10**7], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_input_raises_typed_error(
    engine: LLMEngine, prompt: list[int], sampling: SamplingParams, field: str
) -> None:
    free_before = engine.get_stats().num_free_blocks
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(prompt, sampling)
    assert error.value.field == field
    assert field in str(error.value)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_free_blocks == free_before


def test_prompt_over_context_names_both_numbers(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request([1] * (engine.max_model_len + 10))
    assert str(engine.max_model_len + 10) in str(error.value)
    assert str(engine.max_model_len) in str(error.value)


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    request_id = engine.add_request(engine.tokenizer.encode(PROMPTS[0] * 10), GREEDY)
    engine.step()
    assert engine.get_stats().num_free_blocks < engine.num_kv_blocks
    engine.abort(request_id)
    events = list(engine.stream())
    assert [e.finish_reason for e in events if e.request_id == request_id] == [FinishReason.ABORT]
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks


def test_stop_token_and_min_new_tokens(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[0])
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free_run[3]
    stopped = engine.generate([prompt], replace(GREEDY, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free_run[: free_run.index(stop_at) + 1]
    held = engine.generate([prompt], replace(GREEDY, stop_token_ids=(stop_at,), min_new_tokens=10))[
        0
    ]
    assert len(held.token_ids) > 10
    assert stop_at not in held.token_ids[:10]


def test_seeded_sampling_is_reproducible_across_batches(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[2])
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=16)
    alone = engine.generate([prompt], seeded)[0].token_ids
    others = [engine.tokenizer.encode(text) for text in PROMPTS[:5]]
    batched = engine.generate(
        [*others, prompt], [SamplingParams(temperature=1.0, max_new_tokens=16)] * 5 + [seeded]
    )[-1].token_ids
    assert alone == batched


def run_choices(engine: LLMEngine, prompt: list[int], sampling: SamplingParams) -> list[list[int]]:
    request_id = engine.add_request(prompt, sampling)
    tokens: list[list[int]] = [[] for _ in range(sampling.n)]
    for event in engine.stream():
        if event.request_id == request_id:
            tokens[event.index].extend(event.new_token_ids)
    return tokens


def test_forked_choices_compute_what_separate_requests_do(loaded_fp32: LoadedModel) -> None:
    """n choices read the prompt's KV through shared blocks and a copied partial block: greedy
    choices equal a lone greedy run, and seeded choice i equals a lone run with seed s + i."""
    engine = make_engine(loaded_fp32, enable_prefix_caching=False)
    block_size = engine.config.block_size
    prompt = engine.tokenizer.encode(PROMPTS[1] * 4)
    prompt = prompt[: (len(prompt) - 2) // block_size * block_size + 5]  # a partial last block
    assert len(prompt) > block_size and (len(prompt) - 1) % block_size
    alone = run_alone(loaded_fp32, prompt, GREEDY)
    assert run_choices(engine, prompt, replace(GREEDY, n=3)) == [alone] * 3
    stats = engine.get_stats()
    assert stats.num_forked_block_refs == 2 * ((len(prompt) - 1) // block_size)
    assert stats.num_block_copies == 2
    assert stats.num_free_blocks == stats.num_total_blocks
    seeded = SamplingParams(temperature=1.0, seed=77, max_new_tokens=12)
    choices = run_choices(engine, prompt, replace(seeded, n=3))
    assert choices == [
        run_alone(loaded_fp32, prompt, replace(seeded, seed=77 + i)) for i in range(3)
    ]
    assert len({tuple(c) for c in choices}) == 3


def test_a_one_token_chunk_after_a_prefix_hit_does_not_sample(loaded_fp32: LoadedModel) -> None:
    """A prompt whose first block comes from the prefix cache, admitted with one token of the
    step budget left, computes that one token as a prefill chunk: it samples nothing, and its
    output is the one it has alone (it once sampled there, as if the chunk were a decode)."""
    engine = make_engine(loaded_fp32, max_num_batched_tokens=32)
    block_size = engine.config.block_size
    text = engine.tokenizer.encode(PROMPTS[2] * 4)
    probe = text[: 2 * block_size - 1]
    other = engine.tokenizer.encode(PROMPTS[3] * 8)[:32]
    engine.generate([probe[: block_size + 3]], GREEDY)  # caches the probe's first block
    plans: list[BatchPlan] = []
    execute = engine.runner.execute

    def recorded(plan: BatchPlan) -> StepResult:
        plans.append(plan)
        return execute(plan)

    engine.runner.execute = recorded  # type: ignore[method-assign]
    other_id = engine.add_request(other[:31], GREEDY)  # 31 of the 32 budget tokens
    probe_id = engine.add_request(probe, GREEDY)
    outputs: dict[str, list[int]] = {other_id: [], probe_id: []}
    for event in engine.stream():
        outputs[event.request_id].extend(event.new_token_ids)
    first = plans[0]
    assert first.num_scheduled_tokens == {other_id: 31, probe_id: 1}
    assert [s.num_computed_tokens for s in first.new_sequences] == [0, block_size]
    assert outputs[probe_id] == run_alone(loaded_fp32, probe, GREEDY)
    assert outputs[other_id] == run_alone(loaded_fp32, other[:31], GREEDY)
