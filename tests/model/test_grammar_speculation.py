"""Speculation under grammars on the embedded model: JSON extraction and a forced tool call's
schema draft from the prompt (prompt lookup and the suffix cache), greedy output is token for
token the same with and without drafts, and several sampled runs (unseeded) stay valid every
time, with drafts accepted along the way."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.engine.engine import LLMEngine
from services.text.chat_template import ChatMessage
from services.worker.loaded_model import LoadedModel
from tests.model.test_speculative_decoding import engine_for

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "city", "age"],
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
    "required": ["name", "arguments"],
}
TEXTS = [
    "Maria Lopez lives in Porto and is 34 years old.",
    "Jonas Berg, 51, moved to Bergen last spring.",
    "The engineer Amara Okafor (29) works in Lagos.",
]
SPECULATING = {"speculative_ngram": 5, "speculative_suffix_cache_tokens": 8192}


def cases(loaded: LoadedModel) -> list[tuple[list[int], dict]]:
    tokenizer = loaded.tokenizer
    extract = [
        tokenizer.apply_chat_template(
            [ChatMessage("user", f"Extract name, city and age as JSON: {text}")]
        )
        for text in TEXTS
    ]
    tool = tokenizer.apply_chat_template(
        [ChatMessage("user", "Call get_weather for the city Maria Lopez lives in: Porto.")]
    )
    return [*((ids, PERSON) for ids in extract), (tool, TOOL_CALL)]


def run(engine: LLMEngine, loaded: LoadedModel, temperature: float) -> list[tuple[str, dict]]:
    items = cases(loaded)
    params = [
        SamplingParams(
            temperature=temperature,
            max_new_tokens=96,
            structured_output=StructuredOutput(
                StructuredOutputKind.JSON_SCHEMA, json.dumps(schema)
            ),
        )
        for _, schema in items
    ]
    results = engine.generate([ids for ids, _ in items], params)
    engine.scheduler.check_integrity()
    texts = []
    for result, (_, schema) in zip(results, items, strict=True):
        assert result.finish_reason is FinishReason.STOP, result.text
        jsonschema.validate(json.loads(result.text), schema)
        texts.append((result.text, schema))
    return texts


def test_greedy_constrained_output_is_the_same_with_drafts(loaded_fp32: LoadedModel) -> None:
    plain = run(engine_for(loaded_fp32, speculation=False), loaded_fp32, 0.0)
    engine = engine_for(loaded_fp32, **SPECULATING)
    # Twice: the second round also drafts from the first's answers (the suffix cache).
    assert run(engine, loaded_fp32, 0.0) == plain
    assert run(engine, loaded_fp32, 0.0) == plain
    stats = engine.get_stats()
    assert stats.num_draft_tokens_accepted > 20, stats
    assert engine.runner.grammars is not None and len(engine.runner.grammars) == 0


@pytest.mark.parametrize("attempt", range(4))
def test_sampled_constrained_runs_with_drafts_are_always_valid(
    loaded_fp32: LoadedModel, attempt: int
) -> None:
    # Unseeded: a worker with a --seed keeps sampled sequences from drafting.
    engine = engine_for(loaded_fp32, seed=None, **SPECULATING)
    for _ in range(2):
        run(engine, loaded_fp32, 0.9)  # asserts every output validates
    assert engine.get_stats().num_draft_tokens_accepted > 0
