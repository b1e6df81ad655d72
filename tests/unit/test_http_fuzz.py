"""Malformed bodies sent to the HTTP doors of a real tokenizer tier (scripted scheduler):
wrong types for every parameter, NaN and Infinity, huge integers, deep nesting, long arrays,
invalid UTF-8, lone surrogates, truncated JSON, a wrong Content-Type, empty and non-object
bodies. Each gets a 4xx in its door's shape (never a 500, never a hang), naming the parameter
at fault where there is one; afterwards the replica serves, and no request reached the
scheduler."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    running_stack,
    script_for,
    served_model,
)

MODEL = "SmolLM2-135M-Instruct"
NAN, INF = float("nan"), float("inf")
HUGE_DIGITS = "9" * 5000  # past what Python's int() parses by default
HELLO = [{"role": "user", "content": "hi"}]

BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": HELLO},
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": HELLO},
}

_INT, _BOOL = ("1", 1.5, True), ("yes", 1)
_SHARED_OPENAI: dict[str, tuple[Any, ...]] = {
    "model": (5, None),
    "max_tokens": (*_INT, 2**80),
    "temperature": ("1", True, NAN, INF),
    "top_p": ("1", NAN),
    "stop": (5, [1], {"a": 1}),
    "seed": ("1", 2**80),
    "presence_penalty": ("1", -INF),
    "frequency_penalty": (NAN, []),
    "logit_bias": ([], {"5": "x"}, {"5": NAN}),
    "user": (5,),
    "stream": _BOOL,
    "stream_options": ("x", {"include_usage": "x"}),
    "n": (1.5, 2**80),
    "top_k": ("1", 2**31),
    "min_p": (NAN, "x"),
    "repetition_penalty": (INF, "x"),
    "ignore_eos": _BOOL,
    "min_tokens": ("1", -1),
    "stop_token_ids": ("x", [1.5], [2**80]),
    "allowed_token_ids": ({}, ["x"]),
    "return_token_ids": ("yes",),
    "structured_outputs": ("x", {"json": NAN}),
    "guided_json": (5,),
    "guided_regex": (5,),
    "guided_grammar": ([],),
    "deadline_ms": ("1", 2**40),
    "tenant_id": (5,),
    "num_speculative_tokens": ("1", 2**80),
    "no_such_parameter": (1,),
}
FIELDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "/v1/chat/completions": {
        **_SHARED_OPENAI,
        "messages": ("x", [], [5], [{"role": 5, "content": "hi"}], [{"role": "user"}]),
        "max_completion_tokens": _INT,
        "logprobs": _BOOL,
        "top_logprobs": ("1", 99),
        "prompt_name": (5,),
        "response_format": ("x", {"type": 5}, {"type": "json_schema", "json_schema": NAN}),
        "tools": ("x", [5], [{"type": "function", "function": {"name": 5}}]),
        "tool_choice": (5, {"type": "function"}),
        "parallel_tool_calls": ("x",),
    },
    "/v1/completions": {
        **_SHARED_OPENAI,
        "prompt": (5, {}, [1.5], [[1, "x"]], None),
        "logprobs": (True, "1", 99),
        "echo": ("x",),
        "suffix": (5,),
        "best_of": ("x",),
    },
    "/v1/messages": {
        "model": (5, None),
        "messages": ("x", [], [5], [{"role": "user", "content": 5}]),
        "max_tokens": (*_INT, 0, 2**80),
        "system": (5, [5]),
        "stop_sequences": ("x", [5]),
        "temperature": ("1", NAN, INF),
        "top_p": (NAN, 2),
        "top_k": (1.5, "1"),
        "stream": _BOOL,
        "metadata": ("x", {"user_id": 5}),
        "tools": ("x", [{"name": "f"}]),
        "tool_choice": ("x", {"type": 5}),
        "thinking": ("x",),
        "service_tier": (5,),
        "cache_control": ("x",),
        "no_such_parameter": (1,),
    },
}


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes
    field: str | None = None
    """The parameter the error must name (None: the body as a whole)."""
    content_type: str = "application/json"


def _encode(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity written as JSON's extensions


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def cases() -> list[Case]:
    out: list[Case] = []
    for path, fields in FIELDS.items():
        base = BASES[path]
        for name, values in fields.items():
            out += [Case(path, _encode({**base, name: value}), name) for value in values]
        text = _encode(base).decode()
        message_field = "messages[0].content" if path != "/v1/completions" else "prompt"
        surrogate = text.replace('"hi"', '"\\ud800 x"')
        spec = "response_format" if path == "/v1/chat/completions" else "structured_outputs"
        deep_field = "metadata" if path == "/v1/messages" else spec
        out += [
            Case(path, b"", None),
            Case(path, b"   ", None),
            Case(path, text[:-3].encode(), None),  # truncated
            Case(path, text.encode()[:-1] + b',"x":\xff\xfe}', None),  # invalid UTF-8
            Case(path, b"[]", None),
            Case(path, b'"text"', None),
            Case(path, b"5", None),
            Case(path, b"null", None),
            Case(path, b"{'model': 'single quotes'}", None),
            Case(path, text.encode(), None, content_type="text/plain"),
            Case(path, text.encode(), None, content_type="application/x-www-form-urlencoded"),
            Case(path, surrogate.encode(), message_field),
            Case(path, text.replace(f'"{MODEL}"', '"\\udc00"').encode(), "model"),
            Case(path, (text[:-1] + f',"seed":{HUGE_DIGITS}}}').encode(), "seed"),
            Case(path, (text[:-1] + f',"{deep_field}":{_nested(100)}}}').encode(), deep_field),
            Case(path, (text[:-1] + f',"{deep_field}":{_nested(5000)}}}').encode(), None),
            Case(path, (text[:-1] + ',"temperature":NaN}').encode(), "temperature"),
            Case(path, (text[:-1] + ',"temperature":1e999}').encode(), "temperature"),
        ]
    long_ids = json.dumps([0] * 1_100_000)
    chat = _encode(BASES["/v1/chat/completions"]).decode()[:-1]
    out += [
        Case("/v1/completions", f'{{"model":"{MODEL}","prompt":{long_ids}}}'.encode(), "prompt"),
        Case("/v1/chat/completions", f'{chat},"stop_token_ids":{long_ids}}}'.encode(), "stop"),
        Case(
            "/v1/chat/completions",
            _encode({**BASES["/v1/chat/completions"], "messages": HELLO * 300}),
            "messages",
        ),
        Case(
            "/v1/chat/completions",
            _encode(
                {**BASES["/v1/chat/completions"], "logit_bias": {str(i): 1 for i in range(20000)}}
            ),
            "logit_bias",
        ),
        Case(
            "/v1/messages",
            _encode(
                {
                    **BASES["/v1/messages"],
                    "messages": [{"role": "user", "content": [{"type": "image"}]}],
                }
            ),
            "messages[0].content[0].type",
        ),
    ]
    return out


def _named(case: Case, body: dict[str, Any]) -> bool:
    if case.path == "/v1/messages":
        assert body["type"] == "error", body
        return case.field in body["error"]["message"]  # type: ignore[operator]
    error = body["error"]
    names = {case.field}
    if case.path == "/v1/chat/completions" and case.field == "max_tokens":
        names.add("max_completion_tokens")  # chat names the output bound by its newer name
    return any(name in (error["param"] or "") or name in error["message"] for name in names)  # type: ignore[operator]


def test_malformed_bodies_get_a_4xx_naming_the_field_and_leave_the_replica_serving() -> None:
    model = served_model()
    all_cases = cases()
    assert len(all_cases) >= 100

    async def scenario() -> None:
        engine = FakeEngine(script_for([5, 6], finish_reason="stop"))
        async with running_stack(model, [engine]) as stack:
            assert stack.server.http is not None
            base = f"http://127.0.0.1:{stack.server.http.port}"
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                for case in all_cases:
                    headers = {"content-type": case.content_type}
                    answer = await client.post(case.path, content=case.body, headers=headers)
                    where = (case.path, case.field, case.body[:120])
                    assert 400 <= answer.status_code < 500, (where, answer.text[:300])
                    body = answer.json()
                    assert "error" in body, (where, body)
                    if case.field is not None:
                        assert _named(case, body), (where, body)
                assert engine.requests == []  # nothing malformed reached the scheduler
                ok = await client.post("/v1/chat/completions", json=BASES["/v1/chat/completions"])
                assert ok.status_code == 200, ok.text
            assert len(engine.requests) == 1
            for _ in range(50):
                if stack.server.http.num_connections == 0:
                    break
                await asyncio.sleep(0.02)
            assert stack.server.http.num_connections == 0

    asyncio.run(asyncio.wait_for(scenario(), 120))
