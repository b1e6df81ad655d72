"""The OpenAI-compatible HTTP door of a real stack (`llmserve up`, two tokenizer replicas
sharing the HTTP port, the embedded model in float32), driven by the official `openai` client,
by httpx on the raw bytes, and compared with the gRPC door."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name three fruits."}]


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)


def grpc_ids(stack: RunningStack, request: text_pb2.GenerateRequest) -> list[int]:
    stub = stack.text_stub()
    return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]


def test_models_lists_the_served_model(stack: RunningStack) -> None:
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [model_name(stack)]
    [info] = stack.text_stub().ListModels(text_pb2.ListModelsRequest(), timeout=10).models
    assert models.data[0].id == info.name


def test_chat_with_the_openai_client_streaming_and_not(stack: RunningStack) -> None:
    api = client(stack)
    model = model_name(stack)
    whole = api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None
    assert whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.id.startswith("chatcmpl-")

    chunks = list(
        api.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same answer either way
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert not chunks[-1].choices  # the usage chunk
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_the_async_client(stack: RunningStack) -> None:
    model = model_name(stack)

    async def scenario() -> tuple[str, str]:
        api = openai.AsyncOpenAI(base_url=stack.http, api_key="unused", max_retries=0)
        try:
            whole = await api.completions.create(
                model=model, prompt=PROMPT, max_tokens=10, temperature=0
            )
            streamed = await api.completions.create(
                model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True
            )
            parts = [c.choices[0].text async for c in streamed if c.choices]
            return whole.choices[0].text, "".join(parts)
        finally:
            await api.close()

    whole, streamed = asyncio.run(scenario())
    assert whole and whole == streamed


def test_completions_default_to_16_tokens(stack: RunningStack) -> None:
    response = client(stack).completions.create(
        model=model_name(stack),
        prompt=PROMPT,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage is not None
    assert response.usage.completion_tokens == 16
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_ids_over_http_equal_grpc(stack: RunningStack, chat: bool) -> None:
    api = client(stack)
    body = {"return_token_ids": True, "ignore_eos": True}
    if chat:
        response = api.chat.completions.create(
            model=model_name(stack),
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
            extra_body=body,
        )
        request = text_pb2.GenerateRequest(
            messages=[text_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])]
        )
    else:
        response = api.completions.create(  # type: ignore[assignment]
            model=model_name(stack), prompt=PROMPT, max_tokens=24, temperature=0, extra_body=body
        )
        request = text_pb2.GenerateRequest(prompt=PROMPT)
    request.sampling.temperature = 0
    request.sampling.max_new_tokens = 24
    request.sampling.ignore_eos = True
    http_ids = response.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert len(http_ids) == 24
    assert http_ids == grpc_ids(stack, request)


def test_sse_framing_on_the_raw_bytes(stack: RunningStack) -> None:
    body = {
        "model": model_name(stack),
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{stack.http}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        raw = b"".join(response.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""  # every event ends with a blank line
    events = events[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    payloads = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    ids = {p["id"] for p in payloads}
    assert len(ids) == 1 and ids.pop() == "cmpl-" + response.headers["x-request-id"]


def test_logprobs_in_both_shapes(stack: RunningStack) -> None:
    api = client(stack)
    model = model_name(stack)
    chat = api.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert item.logprob <= 0
    assert "".join(item.token for item in content) == chat.choices[0].message.content

    legacy = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == legacy.choices[0].text
    # logprobs=0: no alternatives, only the sampled token's own entry (as vLLM).
    assert logprobs.top_logprobs == [
        {token: logprob}
        for token, logprob in zip(logprobs.tokens, logprobs.token_logprobs or [], strict=True)
    ]
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]


def test_stop_strings_and_seeded_sampling(stack: RunningStack) -> None:
    api = client(stack)
    model = model_name(stack)
    free = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    stop = free.text[3:6]
    assert stop.strip(), free.text
    cut = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    seeded = [
        api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/completions", {"prompt": "a", "n": 17}, 400, "n"),
        ("/completions", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
        ("/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
        ("/completions", {"prompt": "a", "max_tokens": 100000}, 400, "max_tokens"),
        ("/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
        ("/chat/completions", {"messages": []}, 400, "messages"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
        (
            "/chat/completions",
            {"messages": MESSAGES, "tools": [{"type": "x"}]},
            400,
            "tools[0].type",
        ),
        ("/chat/completions", {"messages": MESSAGES, "prompt_name": "nope"}, 404, "prompt_name"),
    ],
)
def test_bad_requests_get_openai_errors(
    stack: RunningStack, path: str, body: dict[str, object], status: int, param: str | None
) -> None:
    response = httpx.post(
        f"{stack.http}{path}", json={"model": model_name(stack), **body}, timeout=30
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages[0].role")


def test_unknown_model_is_404_through_the_client(stack: RunningStack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(stack).completions.create(model="gpt-9", prompt="a", max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_an_unknown_route_is_an_openai_404(stack: RunningStack) -> None:
    response = httpx.get(f"{stack.http}/nothing-here", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_a_passed_deadline_is_504(stack: RunningStack) -> None:
    response = httpx.post(
        f"{stack.http}/completions",
        json={
            "model": model_name(stack),
            "prompt": PROMPT,
            "max_tokens": 500,
            "ignore_eos": True,
            "deadline_ms": 300,
        },
        timeout=60,
    )
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert stack.wait_all_blocks_free(timeout_s=5).num_free_blocks == (
        stack.stats().num_total_blocks
    )


def test_health_and_ready(stack: RunningStack) -> None:
    base = stack.http.removesuffix("/v1")
    assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready", timeout=10).status_code == 200


@pytest.mark.parametrize("streaming", [True, False])
def test_a_client_that_disconnects_frees_its_kv_blocks(
    stack: RunningStack, streaming: bool
) -> None:
    body = {
        "model": model_name(stack),
        "prompt": PROMPT,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": streaming,
    }
    # Streaming: leaving the block closes the connection, so the first token may take its time
    # (a busy machine). Not streaming: the read timeout is what closes it mid-generation.
    read_timeout_s = 60.0 if streaming else 1.0
    with httpx.Client(timeout=httpx.Timeout(60, read=read_timeout_s)) as http:
        if streaming:
            with http.stream("POST", f"{stack.http}/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                first_data = next(line for line in lines if line.startswith("data:"))
                assert "text_completion" in first_data
                assert stack.stats().num_running == 1
            # Leaving the block closed the connection mid-stream.
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{stack.http}/completions", json=body)
            # The read timeout closed the connection while the server generated.
    started = time.monotonic()
    stats = stack.wait_all_blocks_free(timeout_s=10)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    # Long before the 1500 tokens would have finished.
    assert time.monotonic() - started < 10


def test_grpc_and_http_share_one_pipeline_of_errors(stack: RunningStack) -> None:
    """The same bad field is refused by both doors, each in its own terms."""
    request = text_pb2.GenerateRequest(prompt="a")
    request.sampling.top_p = 0
    with pytest.raises(grpc.RpcError) as info:
        list(stack.text_stub().Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert info.value.details().startswith("sampling.top_p")  # type: ignore[attr-defined]
    response = httpx.post(
        f"{stack.http}/completions",
        json={"model": model_name(stack), "prompt": "a", "top_p": 0},
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_p"
