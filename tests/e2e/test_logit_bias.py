"""logit_bias and allowed_token_ids through a real stack (tokenizer replicas → scheduler →
worker on the embedded model), by both doors: gRPC Generate and the official `openai` client
on the HTTP door. Bad values are refused naming the field, and every KV block ends up free."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name three fruits."}]
NUM_TOKENS = 12


def grpc_ids(stack: RunningStack, **sampling: Any) -> list[int]:
    request = text_pb2.GenerateRequest(
        prompt=PROMPT,
        sampling=text_pb2.SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True, **sampling),
    )
    return [t for r in stack.text_stub().Generate(request, timeout=120) for t in r.token_ids]


def served_model(stack: RunningStack) -> text_pb2.ModelInfo:
    [info] = stack.text_stub().ListModels(text_pb2.ListModelsRequest(), timeout=10).models
    return info


def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)


def http_ids(stack: RunningStack, chat: bool, **fields: Any) -> list[int]:
    """Token ids of one non-streaming answer; vLLM's parameters go in the extra body."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    if "allowed_token_ids" in fields:
        extra["allowed_token_ids"] = fields.pop("allowed_token_ids")
    api, model = client(stack), served_model(stack).name
    if chat:
        response: Any = api.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, extra_body=extra, **fields
        )
    else:
        response = api.completions.create(
            model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, extra_body=extra, **fields
        )
    return list(response.choices[0].model_extra["token_ids"])


def test_grpc_bias_bans_forces_and_restricts(stack: RunningStack) -> None:
    plain = grpc_ids(stack, temperature=0)
    assert len(plain) == NUM_TOKENS
    banned = grpc_ids(stack, temperature=0, logit_bias={plain[0]: -100})
    assert plain[0] not in banned
    assert banned != plain
    # At temperature 1 (seeded), +100 makes the token win every draw.
    forced_token = plain[3]
    forced = grpc_ids(stack, temperature=1.0, seed=7, logit_bias={forced_token: 100})
    assert forced == [forced_token] * NUM_TOKENS
    allowed = {plain[1], plain[2]}
    restricted = grpc_ids(stack, temperature=1.0, seed=3, allowed_token_ids=sorted(allowed))
    assert len(restricted) == NUM_TOKENS and set(restricted) <= allowed
    # Greedy within the allowed set: its first token is the likelier of the two.
    assert grpc_ids(stack, temperature=0, allowed_token_ids=[plain[0], plain[5]])[0] == plain[0]


@pytest.mark.parametrize("chat", [False, True])
def test_openai_client_bias_bans_forces_and_restricts(stack: RunningStack, chat: bool) -> None:
    plain = http_ids(stack, chat, temperature=0)
    assert len(plain) == NUM_TOKENS
    banned = http_ids(stack, chat, temperature=0, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned and banned != plain
    forced_token = plain[2]
    forced = http_ids(stack, chat, temperature=1.0, seed=11, logit_bias={str(forced_token): 100})
    assert forced == [forced_token] * NUM_TOKENS
    allowed = {plain[0], plain[1]}
    restricted = http_ids(stack, chat, temperature=1.0, seed=5, allowed_token_ids=sorted(allowed))
    assert len(restricted) == NUM_TOKENS and set(restricted) <= allowed


def test_grpc_and_http_agree_on_a_biased_greedy_answer(stack: RunningStack) -> None:
    bias = {13: 5.0, 29: -100.0, 198: 3.5}
    over_grpc = grpc_ids(stack, temperature=0, logit_bias=bias)
    over_http = http_ids(
        stack, False, temperature=0, logit_bias={str(k): v for k, v in bias.items()}
    )
    assert over_grpc == over_http


def bad_grpc_requests(vocab_size: int) -> list[tuple[dict[str, Any], str]]:
    return [
        ({"logit_bias": {5: 100.5}}, "sampling.logit_bias[5]"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias"),
        ({"logit_bias": {vocab_size: 1.0}}, f"sampling.logit_bias[{vocab_size}]"),
        ({"allowed_token_ids": [1, vocab_size]}, "sampling.allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "sampling.allowed_token_ids"),
    ]


def test_bad_values_are_refused_by_both_doors_and_leak_no_block(stack: RunningStack) -> None:
    vocab_size = served_model(stack).vocab_size
    assert vocab_size > 0
    for sampling, field in bad_grpc_requests(vocab_size):
        with pytest.raises(grpc.RpcError) as info:
            grpc_ids(stack, temperature=0, **sampling)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert info.value.details().startswith(f"{field}:")  # type: ignore[attr-defined]

    model = served_model(stack).name
    bad_http: list[tuple[dict[str, Any], str]] = [
        ({"logit_bias": {"5": 100.5}}, "logit_bias[5]"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {str(vocab_size): 1}}, f"logit_bias[{vocab_size}]"),
        ({"logit_bias": {"the": -100}}, "logit_bias"),
        ({"allowed_token_ids": [vocab_size]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ]
    for path, base in (
        ("/completions", {"prompt": PROMPT}),
        ("/chat/completions", {"messages": MESSAGES}),
    ):
        for fields, param in bad_http:
            response = httpx.post(
                f"{stack.http}{path}", json={"model": model, **base, **fields}, timeout=30
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param

    # And through the official client, which raises its own typed error.
    with pytest.raises(openai.BadRequestError) as raised:
        client(stack).completions.create(
            model=model, prompt=PROMPT, max_tokens=4, logit_bias={"5": 101}
        )
    assert raised.value.status_code == 400
    assert "logit_bias[5]" in str(raised.value)

    stats = stack.wait_all_blocks_free(timeout_s=10)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
