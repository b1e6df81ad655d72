"""Integers past what the wire carries (int32 top_k, int64 seed, uint32 deadline_ms) sent to the
OpenAI door of a real tokenizer tier (scripted scheduler): each gets a 400 naming the field,
never a 500 from the protobuf conversion, and the replica serves the next request."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    run,
    running_stack,
    script_for,
    served_model,
)

CASES: list[tuple[str, dict[str, Any], str]] = [
    (path, {name: value}, name)
    for path in ("chat/completions", "completions")
    for name, value in (
        ("seed", 2**80),
        ("seed", -(2**80)),
        ("seed", 2**63),
        ("top_k", 2**31),
        ("top_k", 2**80),
        ("deadline_ms", 2**32),
        ("max_tokens", 2**80),
        ("n", 2**80),
        ("min_tokens", 2**80),
        ("num_speculative_tokens", 2**80),
        ("stop_token_ids", [2**80]),
        ("allowed_token_ids", [2**80]),
        ("logit_bias", {str(2**80): 1}),
    )
]


def test_huge_integers_are_refused_by_name() -> None:
    model = served_model()
    engine = FakeEngine(script_for([5, 6], finish_reason="stop"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            assert stack.server.http is not None
            base = f"http://127.0.0.1:{stack.server.http.port}/v1"
            async with httpx.AsyncClient(timeout=10) as client:
                for path, fields, name in CASES:
                    body: dict[str, Any] = {"model": model.name, **fields}
                    if path == "completions":
                        body["prompt"] = "hi"
                    else:
                        body["messages"] = [{"role": "user", "content": "hi"}]
                    answer = await client.post(f"{base}/{path}", json=body)
                    assert answer.status_code == 400, (path, fields, answer.text)
                    error = answer.json()["error"]
                    # Chat names the output bound by its current name, whichever was sent.
                    if path == "chat/completions" and name == "max_tokens":
                        name = "max_completion_tokens"
                    named = name in (error["param"] or "") or name in error["message"]
                    assert named, (path, fields, answer.text)
                ok = await client.post(
                    f"{base}/completions", json={"model": model.name, "prompt": "hi", "seed": 7}
                )
                assert ok.status_code == 200, ok.text

    run(scenario)


@pytest.mark.parametrize("value", [2**63 - 16, -(2**63)])
def test_the_widest_seeds_still_serve(value: int) -> None:
    model = served_model()

    async def scenario() -> None:
        engine = FakeEngine(script_for([5], finish_reason="stop"))
        async with running_stack(model, [engine]) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/completions"
            body = {"model": model.name, "prompt": "hi", "seed": value}
            answer = await asyncio.to_thread(httpx.post, url, json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        assert engine.requests[0].sampling.seed == value

    run(scenario)
