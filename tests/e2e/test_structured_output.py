"""Structured output on a real stack of its own (`llmserve up`, the embedded model in float32 on
its exact weights, whose decode steps run fused in C++): JSON schemas, a JSON object, a regex
and an EBNF grammar through the gRPC door and the OpenAI HTTP door; every output checked
against its spec, bad specs refused at the edge, every KV block free at the end."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack
from tests.e2e.test_metrics import parse_samples, scrape, total

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(exact_stack: RunningStack) -> RunningStack:
    """Exact fp32 arithmetic (`gguf-exact`): a greedy free-form JSON object ends by the model's
    choice alone, and under int8 activation rounding (the gguf default) the embedded model's
    greedy cat object loops on one repeated key and never closes within the token budget."""
    return exact_stack


@pytest.fixture(scope="module")
def prepares_at_start(stack: RunningStack) -> dict[str, float]:
    """The worker's grammar counts before this file's first request (the session's stack may
    have served other files' grammars first)."""
    return _prepares(stack)


MAX_NEW_TOKENS = 160


def _str(max_length: int = 10, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or list(properties)}


# (what to ask for, its schema): nested objects, arrays, enums, bounded numbers, required and
# optional fields, string patterns. Strings and arrays are bounded so that every output fits
# MAX_NEW_TOKENS whatever a sampled run picks.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a color", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("a yes/no answer", _obj({"answer": {"type": "boolean"}})),
    (
        "a city",
        _obj({"city": _str(12), "population": {"type": "integer", "minimum": 1, "maximum": 99999}}),
    ),
    ("a book", _obj({"title": _str(), "author": _obj({"first": _str(8), "last": _str(8)})})),
    (
        "a shopping list",
        _obj({"items": {"type": "array", "items": _str(8), "minItems": 1, "maxItems": 3}}),
    ),
    ("a score", _obj({"score": {"type": "integer", "minimum": -10, "maximum": 10}})),
    ("a product code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}})),
    ("a date", _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("a pet", _obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": _str(8)}, ["kind"])),
    (
        "a point",
        _obj(
            {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            }
        ),
    ),
    (
        "a list of numbers",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
    ),
    (
        "a user",
        _obj(
            {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "tags": {"type": "array", "items": {"enum": ["admin", "guest"]}, "maxItems": 2},
            }
        ),
    ),
    (
        "a rating",
        _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": _str(12)}),
    ),
    (
        "a team",
        _obj(
            {
                "lead": _obj({"name": _str(8)}),
                "size": {"type": "integer", "minimum": 1, "maximum": 20},
            }
        ),
    ),
    ("a word", _obj({"word": {"type": "string", "pattern": "^[a-z]{2,6}$"}})),
    (
        "a status",
        _obj(
            {
                "status": {"enum": ["ok", "error"]},
                "code": {"type": "integer", "minimum": 100, "maximum": 599},
            }
        ),
    ),
    (
        "a flag set",
        _obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "null"}}),
    ),
    (
        "a matrix",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 2,
            },
            "maxItems": 2,
        },
    ),
    (
        "an event",
        _obj(
            {
                "name": _str(8),
                "when": _obj(
                    {
                        "day": {"type": "integer", "minimum": 1, "maximum": 31},
                        "month": {"enum": ["jan", "feb"]},
                    }
                ),
                "note": _str(6),
            },
            ["name", "when"],
        ),
    ),
]

REGEX = r"[A-Z][a-z]{2,6} [0-9]{2}"
GRAMMAR = """root ::= answer " " number
answer ::= "yes" | "no" | "maybe"
number ::= [1-9] [0-9]?
"""
GRAMMAR_AS_REGEX = r"(yes|no|maybe) [1-9][0-9]?"


def _generate(
    stack: RunningStack,
    content: str,
    spec: dict[str, Any],
    *,
    temperature: float = 0.0,
    seed: int | None = None,
) -> tuple[str, str]:
    """(text, finish reason) of one chat request through the gRPC door."""
    sampling = text_pb2.SamplingParams(
        temperature=temperature, max_new_tokens=MAX_NEW_TOKENS, structured_output=spec
    )
    if seed is not None:
        sampling.seed = seed
    request = text_pb2.GenerateRequest(
        messages=[text_pb2.ChatMessage(role="user", content=content)], sampling=sampling
    )
    responses = list(stack.text_stub().Generate(request, timeout=300))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def _prepares(stack: RunningStack) -> dict[str, float]:
    samples = parse_samples(scrape(stack.info["metrics"]))
    return {
        outcome: total(samples, "llmserve_worker_grammar_prepares_total", outcome=outcome)
        for outcome in ("compiled", "cached", "refused")
    }


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 1234)])
def test_twenty_json_schemas_in_one_batch_give_valid_json(
    stack: RunningStack,
    prepares_at_start: dict[str, float],
    temperature: float,
    seed: int | None,
) -> None:
    def run(index: int) -> tuple[str, str]:
        what, schema = SCHEMAS[index]
        spec = {"json_schema": json.dumps(schema)}
        return _generate(
            stack, f"Reply with JSON describing {what}.", spec, temperature=temperature, seed=seed
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        outputs = list(pool.map(run, range(len(SCHEMAS))))
    for (what, schema), (text, finish_reason) in zip(SCHEMAS, outputs, strict=True):
        assert finish_reason == "stop", (what, text)
        jsonschema.validate(json.loads(text), schema)
    # Every schema compiled once on the worker, off its step loop: the first run compiles
    # each one, the second finds them all compiled.
    prepares = {key: count - prepares_at_start[key] for key, count in _prepares(stack).items()}
    assert prepares["compiled"] == len(SCHEMAS)
    assert prepares["cached"] == (len(SCHEMAS) if temperature else 0)
    assert stack.wait_all_blocks_free(timeout_s=10).num_free_blocks == (
        stack.stats().num_total_blocks
    )


def test_regex_grammar_and_json_object(stack: RunningStack) -> None:
    asks = [
        ("Name a city and a number.", {"regex": REGEX}),
        ("Answer with yes or no and a number.", {"grammar": GRAMMAR}),
        ("Describe a cat as a JSON object.", {"json_object": True}),
    ]
    with ThreadPoolExecutor(len(asks)) as pool:  # independent: in flight at once
        (regex, grammar, json_object) = pool.map(lambda ask: _generate(stack, *ask), asks)
    text, finish_reason = regex
    assert finish_reason == "stop" and re.fullmatch(REGEX, text), text
    text, finish_reason = grammar
    assert finish_reason == "stop" and re.fullmatch(GRAMMAR_AS_REGEX, text), text
    text, finish_reason = json_object
    assert finish_reason == "stop" and isinstance(json.loads(text), dict), text
    # Seeded sampling: the same seed gives the same constrained output (each run alone).
    first = _generate(stack, "Name a city.", {"regex": REGEX}, temperature=1.0, seed=7)
    assert first == _generate(stack, "Name a city.", {"regex": REGEX}, temperature=1.0, seed=7)
    assert re.fullmatch(REGEX, first[0])


def test_the_openai_client_gets_structured_output(stack: RunningStack) -> None:
    api = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=300)
    model = str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])
    what, schema = SCHEMAS[4]

    def book() -> Any:
        return api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Reply with JSON describing {what}."}],
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "book", "schema": schema, "strict": True},
            },
        )

    def cat() -> Any:
        return api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
            response_format={"type": "json_object"},
        )

    def city() -> Any:
        return api.completions.create(
            model=model,
            prompt="A city and a number:",
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
            extra_body={"guided_regex": REGEX},
        )

    def sky() -> Any:
        return api.completions.create(
            model=model,
            prompt="Is the sky blue?",
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
            extra_body={"structured_outputs": {"grammar": GRAMMAR}},
        )

    with ThreadPoolExecutor(4) as pool:  # independent: in flight at once
        futures = [pool.submit(ask) for ask in (book, cat, city, sky)]
        reply, cat_reply, completion, sky_completion = [f.result() for f in futures]
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
    assert isinstance(json.loads(cat_reply.choices[0].message.content or ""), dict)
    assert re.fullmatch(REGEX, completion.choices[0].text)
    assert re.fullmatch(GRAMMAR_AS_REGEX, sky_completion.choices[0].text)
    assert sky_completion.choices[0].finish_reason == "stop"


BAD_SPECS = [
    ({"json_schema": '{"type": "objekt"}'}, "sampling.structured_output.json_schema"),
    ({"json_schema": '{"type": "object"'}, "sampling.structured_output.json_schema"),
    ({"regex": "a(b"}, "sampling.structured_output.regex"),
    ({"grammar": "root ::= undefined_rule"}, "sampling.structured_output.grammar"),
]


def test_bad_specs_are_refused_at_the_edge_and_never_reach_the_worker(
    stack: RunningStack,
) -> None:
    before = _prepares(stack)
    for spec, field in BAD_SPECS:
        with pytest.raises(grpc.RpcError) as caught:
            _generate(stack, "Hello", spec)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith(f"{field}: "), caught.value.details()
        assert "/project/" not in (caught.value.details() or "")
    # Refused with the parameter named as the HTTP API spells it.
    model = httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"]
    bad_schema = {"name": "x", "schema": {"type": "objekt"}}
    bodies = [
        (
            {"response_format": {"type": "json_schema", "json_schema": bad_schema}},
            "response_format",
        ),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
        ({"guided_json": {"type": "number"}, "ignore_eos": True}, "ignore_eos"),
    ]
    for extra, param in bodies:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra}
        response = httpx.post(f"{stack.http}/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    after = _prepares(stack)
    assert after == before  # the scheduler and the worker never saw them
    assert stack.wait_all_blocks_free(timeout_s=10).num_free_blocks == (
        stack.stats().num_total_blocks
    )
