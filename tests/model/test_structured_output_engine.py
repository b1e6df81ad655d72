"""Structured output in the in-process engine on the real model: preempted sequences come back
with their matcher rebuilt from their output, so a constrained greedy output is the same with
and without preemption, and stays inside its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.worker.loaded_model import LoadedModel
from tests.model.test_engine_behaviour import make_engine, mixed_prompts, run_alone

pytestmark = pytest.mark.slow

# A string that cannot end before 60 characters: no sequence completes in 32 tokens, so every
# one keeps growing and the small cache must preempt.
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 60, "maxLength": 80}},
    "required": ["story"],
}
CONSTRAINED = SamplingParams(
    temperature=0.0,
    max_new_tokens=32,
    structured_output=StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
)


def test_preempted_constrained_sequences_replay_their_matchers(loaded_fp32: LoadedModel) -> None:
    spec_bytes = make_engine(loaded_fp32).kv_cache.spec.bytes_per_block
    # 16 blocks of 16 tokens; the 6 sequences need 23 at their longest: decodes must preempt.
    engine = make_engine(
        loaded_fp32, kv_cache_gib=16 * spec_bytes / 2**30, enable_prefix_caching=False
    )
    prompts = [p[:30] for p in mixed_prompts(engine, 6)]
    results = engine.generate(prompts, CONSTRAINED)
    assert engine.get_stats().num_preemptions > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == run_alone(loaded_fp32, prompt, CONSTRAINED)
        if result.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(result.text), SCHEMA)
        else:  # cut by max_new_tokens: the start of a document
            assert result.text.startswith('{"story": "'), result.text
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks
    assert engine.runner.grammars is not None and len(engine.runner.grammars) == 0


def test_every_choice_has_its_own_matcher_and_keeps_the_bias(loaded_fp32: LoadedModel) -> None:
    """n = 3 sampled choices of one prompt under one schema, with a logit_bias banning a digit:
    the forked choices each follow the grammar from the token they fork at (a shared matcher
    would see three tokens per step and refuse them), every output validates, none holds the
    banned token, and each equals its own lone run with seed s + i."""
    from dataclasses import replace

    from tests.model.test_engine_behaviour import run_choices

    engine = make_engine(loaded_fp32)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
    }
    banned = engine.tokenizer.encode("7")
    assert len(banned) == 1
    sampling = SamplingParams(
        temperature=1.0,
        seed=5,
        max_new_tokens=24,
        logit_bias=((banned[0], -100.0),),
        structured_output=StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema)),
    )
    prompt = engine.tokenizer.encode("Pick a number and answer in JSON:")
    choices = run_choices(engine, prompt, replace(sampling, n=3))
    for index, tokens in enumerate(choices):
        assert banned[0] not in tokens
        assert tokens == run_alone(loaded_fp32, prompt, replace(sampling, seed=5 + index))
        text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks
    assert engine.runner.grammars is not None and len(engine.runner.grammars) == 0
