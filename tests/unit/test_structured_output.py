"""Structured output without processes: the spec and its checks, the compile cache and its
errors, the HTTP parameters, the worker's matchers (accept, replay after a preemption), the
sampler's mask on constrained rows only, and the scheduler holding a request until the worker
has its grammar."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from services.common.grammar import GrammarCompiler, xgrammar_message
from services.common.model_source import embedded_model_path
from services.common.sampling_proto import sampling_from_proto, sampling_to_proto
from services.contracts.errors import InvalidRequestError
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.contracts.structured_output import (
    MAX_STRUCTURED_OUTPUT_CHARS,
    StructuredOutput,
    StructuredOutputKind,
)
from services.text.model_tokenizer import ModelTokenizer
from services.tokenizer.http.openai.schemas import (
    parse_chat,
    parse_completion,
    structured_output,
)
from services.tokenizer.validation import Limits, SamplingInput, validate_sampling
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import SamplerRow, build_sampling_metadata
from services.worker.structured_output.matchers import GrammarMatchers
from tests.unit.factories import create_requests, create_scheduler, result_for

K = StructuredOutputKind
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
JSON_SPEC = StructuredOutput(K.JSON_SCHEMA, json.dumps(SCHEMA))
LIMITS = Limits(model_name="m", max_model_len=512, vocab_size=49152, max_new_tokens_limit=256)


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_path(embedded_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer: ModelTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, (2,))


# ---- the spec ---------------------------------------------------------------------------


def test_spec_is_hashable_and_round_trips_through_the_proto() -> None:
    assert len({JSON_SPEC, StructuredOutput(K.JSON_SCHEMA, json.dumps(SCHEMA))}) == 1
    for spec in (JSON_SPEC, StructuredOutput(K.JSON_OBJECT), StructuredOutput(K.REGEX, "a+")):
        params = SamplingParams(structured_output=spec)
        assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).structured_output is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(structured_output=StructuredOutput(K.REGEX, "")), "regex"),
        (
            SamplingParams(
                structured_output=StructuredOutput(
                    K.GRAMMAR, "x" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)
                )
            ),
            "grammar",
        ),
        (SamplingParams(structured_output=StructuredOutput(K.JSON_OBJECT, "{}")), "json_object"),
        (SamplingParams(structured_output=JSON_SPEC, ignore_eos=True), "ignore_eos"),
        (SamplingParams(structured_output=JSON_SPEC, min_new_tokens=3), "min_new_tokens"),
    ],
)
def test_bad_specs_and_combinations_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        params.validate()
    assert caught.value.field.endswith(field)


def test_validation_names_the_parameter_the_door_used() -> None:
    spec = StructuredOutput(K.REGEX, "")
    with pytest.raises(InvalidRequestError) as caught:
        validate_sampling(SamplingInput(structured_output=spec), LIMITS)
    assert caught.value.field == "sampling.structured_output.regex"
    http = SamplingInput(structured_output=spec, structured_output_param="guided_regex")
    with pytest.raises(InvalidRequestError) as caught:
        validate_sampling(http, LIMITS)
    assert caught.value.field == "guided_regex"


# ---- compiling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput(K.JSON_SCHEMA, '{"type": "objekt"}'), "objekt"),
        (StructuredOutput(K.JSON_SCHEMA, '{"type": "object"'), "not valid JSON"),
        (StructuredOutput(K.JSON_SCHEMA, "[1, 2]"), "JSON Schema"),
        (StructuredOutput(K.REGEX, "a(b"), "parenthesis"),
        (StructuredOutput(K.GRAMMAR, "root ::= foo"), "foo"),
        (StructuredOutput(K.GRAMMAR, "root := 'a'"), "line 1"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_with_a_short_reason(
    compiler: GrammarCompiler, spec: StructuredOutput, words: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        compiler.compile(spec)
    assert caught.value.field == spec.field
    assert words in caught.value.message
    assert "/project/" not in caught.value.message and len(caught.value.message) <= 300


def test_each_distinct_spec_compiles_once_failures_included(compiler: GrammarCompiler) -> None:
    before = compiler.num_compiles
    spec = StructuredOutput(K.REGEX, "[a-c]{2}x")
    first = compiler.compile(spec)
    assert compiler.compile(StructuredOutput(K.REGEX, "[a-c]{2}x")) is first
    assert compiler.is_compiled(spec)
    bad = StructuredOutput(K.REGEX, "(((")
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            compiler.compile(bad)
    assert not compiler.is_compiled(bad)
    assert compiler.num_compiles == before + 2


def test_xgrammar_message_drops_the_source_location() -> None:
    raw = RuntimeError("[01:09:02] /project/cpp/regex_converter.cc:83: Regex error at 4: oops\n")
    assert xgrammar_message(raw) == "Regex error at 4: oops"


# ---- the HTTP parameters -----------------------------------------------------------------


def _chat(**extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return json.dumps(body).encode()


def test_response_format_and_vllm_parameters_become_one_spec() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    spec, param = structured_output(parse_chat(_chat(response_format=fmt)))
    assert (spec, param) == (StructuredOutput(K.JSON_SCHEMA, json.dumps(SCHEMA)), "response_format")
    spec, _ = structured_output(parse_chat(_chat(response_format={"type": "json_object"})))
    assert spec == StructuredOutput(K.JSON_OBJECT)
    assert structured_output(parse_chat(_chat(response_format={"type": "text"}))) == (None, "")
    body = parse_completion(
        json.dumps({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a+"}}).encode()
    )
    assert structured_output(body) == (StructuredOutput(K.REGEX, "a+"), "structured_outputs.regex")
    spec, param = structured_output(parse_chat(_chat(guided_grammar='root ::= "a"')))
    assert (spec, param) == (StructuredOutput(K.GRAMMAR, 'root ::= "a"'), "guided_grammar")
    spec, param = structured_output(parse_chat(_chat(guided_json=SCHEMA)))
    assert spec == JSON_SPEC and param == "guided_json"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_grammar": "b"}, "guided_grammar"),
        ({"guided_json": 5}, "guided_json"),
    ],
)
def test_bad_structured_output_parameters_name_themselves(
    extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        structured_output(parse_chat(_chat(**extra)))
    assert caught.value.field == param


# ---- the worker's matchers -----------------------------------------------------------------


def _allowed(mask_row: torch.Tensor, vocab_size: int) -> set[int]:
    logits = torch.zeros(1, vocab_size)
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask_row.unsqueeze(0).clone())
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def _new(request_id: str, spec: StructuredOutput | None, token_ids: list[int], num_prompt: int):  # type: ignore[no-untyped-def]
    return NewSequence(
        request_id, token_ids, num_prompt, [0], 0, SamplingParams(structured_output=spec)
    )


def test_matchers_fill_only_constrained_rows_and_follow_accepted_tokens(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer
) -> None:
    matchers = GrammarMatchers(compiler)
    spec = StructuredOutput(K.REGEX, "ab(c|d)")
    plan = BatchPlan(0, new_sequences=[_new("free", None, [5], 1), _new("re", spec, [5], 1)])
    matchers.apply(plan)
    assert "re" in matchers and "free" not in matchers
    mask = matchers.fill(["free", "re"])
    assert mask is not None and mask.rows == [1]
    vocab = tokenizer.vocab_size
    assert all(tokenizer.decode([t]).startswith("a") for t in _allowed(mask.bitmask[1], vocab))
    a, b = (
        tokenizer.encode("a", add_special_tokens=False),
        tokenizer.encode("b", add_special_tokens=False),
    )
    matchers.accept({"free": 99, "re": a[0]})
    matchers.accept({"re": b[0]})
    mask = matchers.fill(["re"])
    assert mask is not None
    allowed = {tokenizer.decode([t]) for t in _allowed(mask.bitmask[0], vocab)}
    assert allowed == {"c", "d"}
    c = tokenizer.encode("c", add_special_tokens=False)
    matchers.accept({"re": c[0]})
    mask = matchers.fill(["re"])
    assert mask is not None and _allowed(mask.bitmask[0], vocab) == {2}  # only EOS now
    matchers.accept({"re": 2})
    assert matchers.is_terminated("re")
    # A step planned before the scheduler heard of the EOS: unconstrained, nothing accepted.
    assert matchers.fill(["re"]) is None
    matchers.accept({"re": 7})
    matchers.apply(BatchPlan(1, finished_request_ids=["re"]))
    assert len(matchers) == 0 and matchers.fill(["free"]) is None


def test_a_resumed_sequence_replays_its_output(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer
) -> None:
    spec = StructuredOutput(K.JSON_SCHEMA, json.dumps(SCHEMA))
    output = tokenizer.encode('{"name": "Al', add_special_tokens=False)
    live = GrammarMatchers(compiler)
    live.apply(BatchPlan(0, new_sequences=[_new("r", spec, [9, 9], 2)]))
    for token in output:
        live.accept({"r": token})
    resumed = GrammarMatchers(compiler)
    # Preempted: dropped, then sent again whole (prompt + output) in the same plan.
    resumed.apply(BatchPlan(0, new_sequences=[_new("r", spec, [9, 9], 2)]))
    resumed.apply(
        BatchPlan(
            1, finished_request_ids=["r"], new_sequences=[_new("r", spec, [9, 9, *output], 2)]
        )
    )
    live_mask, resumed_mask = live.fill(["r"]), resumed.fill(["r"])
    assert live_mask is not None and resumed_mask is not None
    assert torch.equal(live_mask.bitmask[0], resumed_mask.bitmask[0])
    fresh = GrammarMatchers(compiler)
    fresh.apply(BatchPlan(0, new_sequences=[_new("r", spec, [9, 9], 2)]))
    fresh_mask = fresh.fill(["r"])
    assert fresh_mask is not None
    assert not torch.equal(fresh_mask.bitmask[0], resumed_mask.bitmask[0])


def test_a_gated_grammar_starts_after_its_tag_live_and_resumed(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer
) -> None:
    """A reasoning model's thinking is free; the grammar applies from the token after
    `</think>`, whether the tag comes out live or is replayed after a preemption."""
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    spec = StructuredOutput(K.REGEX, "ab", starts_after=end)
    thinking = tokenizer.encode("<think>I ponder </ think", add_special_tokens=False)
    live = GrammarMatchers(compiler)
    live.apply(BatchPlan(0, new_sequences=[_new("r", spec, [9], 1)]))
    for token in thinking:
        assert live.fill(["r"]) is None  # free while thinking, a near miss included
        live.accept({"r": token})
    for token in end:
        assert live.fill(["r"]) is None
        live.accept({"r": token})
    mask = live.fill(["r"])
    assert mask is not None
    vocab = tokenizer.vocab_size
    assert all(tokenizer.decode([t]).startswith("a") for t in _allowed(mask.bitmask[0], vocab))
    resumed = GrammarMatchers(compiler)
    resumed.apply(BatchPlan(0, new_sequences=[_new("r", spec, [9, *thinking, *end], 1)]))
    resumed_mask = resumed.fill(["r"])
    assert resumed_mask is not None and torch.equal(resumed_mask.bitmask[0], mask.bitmask[0])
    halfway = GrammarMatchers(compiler)
    halfway.apply(BatchPlan(0, new_sequences=[_new("r", spec, [9, *thinking, *end[:-1]], 1)]))
    assert halfway.fill(["r"]) is None
    assert sampling_from_proto(sampling_to_proto(SamplingParams(structured_output=spec))) == (
        SamplingParams(structured_output=spec)
    )


# ---- the sampler -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_masks_only_the_constrained_rows(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer, temperature: float
) -> None:
    vocab = tokenizer.vocab_size
    matchers = GrammarMatchers(compiler)
    spec = StructuredOutput(K.REGEX, "[0-9]+")
    matchers.apply(BatchPlan(0, new_sequences=[_new("a", None, [5], 1), _new("b", spec, [5], 1)]))
    matchers.apply(BatchPlan(1, new_sequences=[_new("c", None, [5], 1)]))
    params = SamplingParams(temperature=temperature, seed=1)
    rows = [SamplerRow(params, (), [], (2,)) for _ in range(3)]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator)
    digits = {t for t in range(vocab) if re.fullmatch("[0-9]+", tokenizer.decode([t]))}
    # The unconstrained rows' favourite is a word, the constrained row's too.
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    logits[:, word] = 50.0
    raw = logits.clone()
    metadata = build_sampling_metadata(rows, vocab, torch.device("cpu"))
    metadata.grammar_mask = matchers.fill(["a", "b", "c"])
    output = Sampler(seed=0)(logits, metadata)
    a, b, c = output.token_ids.tolist()
    assert b in digits
    assert a == word and c == word
    # Rows 0 and 2 are untouched; row 1 lost exactly the non-digits.
    assert torch.equal(logits[0], raw[0]) and torch.equal(logits[2], raw[2])
    assert set(torch.nonzero(logits[1] > -1e30).flatten().tolist()) == digits


# ---- the scheduler ----------------------------------------------------------------------


def test_a_request_waits_for_its_grammar_while_the_ones_behind_go_first() -> None:
    scheduler = create_scheduler(max_num_seqs=4)
    first, second = create_requests(2, num_tokens=8, max_new_tokens=2)
    scheduler.add_request(first, grammar_pending=True)
    scheduler.add_request(second)
    plan = scheduler.schedule(0.0)
    assert list(plan.num_scheduled_tokens) == ["req1"]
    assert [r.request_id for r in scheduler.waiting] == ["req0"]
    scheduler.update(plan, result_for(scheduler, plan), 0.0)
    plan = scheduler.schedule(1.0)
    assert "req0" not in plan.num_scheduled_tokens
    scheduler.update(plan, result_for(scheduler, plan), 1.0)
    assert scheduler.set_grammar_ready("req0")
    plan = scheduler.schedule(2.0)
    assert [s.request_id for s in plan.new_sequences] == ["req0"]
    assert not scheduler.waiting
    scheduler.check_integrity()
    assert not scheduler.set_grammar_ready("unknown")


def test_an_unready_request_counts_toward_the_queue_bound_and_can_be_aborted() -> None:
    scheduler = create_scheduler(max_num_seqs=1, max_waiting_requests=0)
    (request,) = create_requests(1, num_tokens=8)
    scheduler.add_request(request, grammar_pending=True)
    assert scheduler.num_unfinished_requests == 1
    assert not scheduler.grammars.is_ready(request)
    scheduler.abort_request("req0")
    plan = scheduler.schedule(0.0)
    assert plan.is_empty and not scheduler.requests
    assert scheduler.grammars.is_ready(request)  # its feature state left with it
    scheduler.check_integrity()


# ---- the tokenizer tier's compile ----------------------------------------------------------


def test_the_tier_compiles_off_the_loop_and_names_the_parameter(tokenizer: ModelTokenizer) -> None:
    import asyncio

    from services.common.grammar import GrammarCompiler
    from services.tokenizer.grammar_check import GrammarCheck
    from services.tokenizer.validation import ValidatedRequest

    description = tokenizer.describe(
        model_name="m", vocab_size=tokenizer.vocab_size, max_model_len=512, eos_token_ids=()
    )
    check_step = GrammarCheck(GrammarCompiler.from_description(description, cache_size=4))

    def request(spec: StructuredOutput, param: str) -> ValidatedRequest:
        sampling = SamplingParams(structured_output=spec)
        return ValidatedRequest("r", (1, 2), sampling, (), None, b"", param)

    async def check(spec: StructuredOutput, param: str) -> None:
        await check_step.apply(request(spec, param))

    asyncio.run(check(JSON_SPEC, "response_format"))  # compiles: no error
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(check(StructuredOutput(K.REGEX, "a(b"), "guided_regex"))
    assert caught.value.field == "guided_regex" and "parenthesis" in caught.value.message
    bad_schema = StructuredOutput(K.JSON_SCHEMA, '{"type": "objekt"}')
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(check(bad_schema, "sampling.structured_output.json_schema"))
    assert caught.value.field == "sampling.structured_output.json_schema"
