"""The public gRPC door against requests no well-behaved client sends: bytes that do not
decode, fields of the wrong wire type, oversized identifiers and prompts (on the HTTP door
too). Real gRPC on loopback with raw bytes, the fake scheduler of tokenizer_tier_harness."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest

from protos.llmserve.v1 import text_pb2
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    MAX_MODEL_LEN,
    TIMEOUT_S,
    FakeEngine,
    Stack,
    rpc_error,
    run,
    running_stack,
    script_for,
    served_model,
)
from tests.wire_bytes import FIXED32, LEN, VARINT, len_field, tag, varint, varint_field

SERVICE = "/llmserve.v1.TextGeneration/"
BAD_UTF8 = b"ok\xff\xfe"
MAX_DETAILS = 300
"""A status message that quotes the client's input quotes a short prefix only."""


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


def chat_message(role: bytes, content: bytes) -> bytes:
    return len_field(1, role) + len_field(2, content)


HELLO = len_field(3, chat_message(b"user", b"hello"))

# (method, request bytes, the field the status message must start with)
UNDECODABLE = [
    ("Generate", len_field(2, BAD_UTF8), "prompt:"),
    (
        "Generate",
        len_field(1, b"req-1") + len_field(2, b"hi") + len_field(9, BAD_UTF8),
        "tenant_id:",
    ),
    ("Generate", len_field(2, b"hi") + len_field(8, BAD_UTF8), "prompt_name:"),
    ("Generate", len_field(2, b"hi") + len_field(7, BAD_UTF8), "model:"),
    ("Generate", HELLO + len_field(3, chat_message(BAD_UTF8, b"x")), "messages[1].role:"),
    ("Generate", HELLO + len_field(3, chat_message(b"user", BAD_UTF8)), "messages[1].content:"),
    (
        "Generate",
        len_field(2, b"hi") + len_field(5, len_field(11, b"end") + len_field(11, BAD_UTF8)),
        "sampling.stop[1]:",
    ),
    # A length that runs past the end of the request.
    ("Generate", tag(2, LEN) + varint(100) + b"short", "prompt:"),
    # A sub-message whose last field is cut short.
    ("Generate", len_field(5, tag(9, VARINT) + b"\x80"), "sampling.max_new_tokens:"),
    # Wire type 7 does not exist.
    ("Generate", len_field(2, b"hi") + tag(6, 7), "deadline_ms:"),
    ("Tokenize", len_field(1, BAD_UTF8), "text:"),
    ("Tokenize", len_field(2, chat_message(b"user", BAD_UTF8)), "messages[0].content:"),
    ("RegisterPrompt", len_field(1, BAD_UTF8) + len_field(2, b"Be brief."), "name:"),
    ("RegisterPrompt", len_field(1, b"bot") + len_field(2, BAD_UTF8), "system_prompt:"),
    ("DeletePrompt", len_field(1, BAD_UTF8), "name:"),
    ("DeletePrompt", len_field(1, b"bot") + len_field(2, BAD_UTF8), "tenant_id:"),
    ("ListPrompts", len_field(1, BAD_UTF8), "tenant_id:"),
]

# A field the descriptor knows, sent with another wire type: protobuf would drop it and let
# its default apply.
WRONG_WIRE_TYPE = [
    (
        "Generate",
        len_field(2, b"hi") + len_field(5, len_field(9, b"\x05")),
        "sampling.max_new_tokens:",
    ),
    ("Generate", varint_field(2, 7), "prompt:"),
    (
        "Generate",
        len_field(2, b"hi") + len_field(5, tag(1, LEN) + b"\x00"),
        "sampling.temperature:",
    ),
    ("Generate", len_field(2, b"hi") + len_field(6, b"\x01"), "deadline_ms:"),
    ("Generate", HELLO + len_field(3, varint_field(2, 1)), "messages[1].content:"),
    ("Generate", len_field(2, b"hi") + tag(5, FIXED32) + b"\x00\x00\x00\x00", "sampling:"),
    ("Detokenize", len_field(2, b"\x01"), "skip_special_tokens:"),
]


async def call_raw(stack: Stack, method: str, data: bytes) -> list[bytes]:
    """The method's response messages, undecoded."""
    if method == "Generate":
        stream = stack.channel.unary_stream(SERVICE + method)
        return [r async for r in stream(data, timeout=TIMEOUT_S)]
    unary = stack.channel.unary_unary(SERVICE + method)
    return [await unary(data, timeout=TIMEOUT_S)]


def no_tracebacks(records: list[logging.LogRecord]) -> None:
    loud = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]


def check_refusals(
    model: ServedModel,
    caplog: pytest.LogCaptureFixture,
    cases: list[tuple[str, bytes, str]],
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        async with running_stack(model) as stack:
            for method, data, prefix in cases:
                error = await rpc_error(call_raw(stack, method, data))
                assert error.code() == code, (method, prefix, error.details())
                assert error.details().startswith(prefix), (prefix, error.details())
                assert len(error.details()) <= MAX_DETAILS, error.details()
            assert stack.engine.requests == []

    run(scenario)
    no_tracebacks(caplog.records)


def test_undecodable_requests_are_invalid_argument_naming_the_field(
    model: ServedModel, caplog: pytest.LogCaptureFixture
) -> None:
    check_refusals(model, caplog, UNDECODABLE)
    quiet = [r for r in caplog.records if r.getMessage() == "undecodable request"]
    assert len(quiet) == len(UNDECODABLE)
    assert all(r.levelno == logging.INFO for r in quiet)


def test_fields_of_the_wrong_wire_type_are_refused(
    model: ServedModel, caplog: pytest.LogCaptureFixture
) -> None:
    check_refusals(model, caplog, WRONG_WIRE_TYPE)


def test_fields_of_a_newer_client_are_ignored(model: ServedModel) -> None:
    unknown = varint_field(99, 1) + len_field(100, BAD_UTF8)  # unknown numbers: skipped

    async def scenario() -> None:
        async with running_stack(model) as stack:
            request = text_pb2.TokenizeRequest(text="hello").SerializeToString()
            (answer,) = await call_raw(stack, "Tokenize", request + unknown)
            tokens = text_pb2.TokenizeResponse.FromString(answer)
            assert list(tokens.token_ids) == model.tokenizer.encode("hello")

    run(scenario)


# ---- oversized input ------------------------------------------------------------------------

LONG = "n" * 10_000


def generate(**fields: object) -> Callable[[Stack], object]:
    request = text_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    return lambda stack: stack.generate(request)


OVERSIZED = [
    # A prompt name that could never be registered: refused before any lookup.
    (
        generate(messages=[text_pb2.ChatMessage(role="user", content="x")], prompt_name=LONG),
        "prompt_name:",
    ),
    (generate(prompt="hi", tenant_id=LONG), "tenant_id:"),
    (generate(prompt="hi", request_id=LONG), "request_id:"),
    (generate(prompt="hi", model=LONG), "model:"),
    (generate(prompt="hi", sampling=text_pb2.SamplingParams(stop=[LONG])), "sampling.stop:"),
    # Refused by its size, before tokenization.
    (generate(prompt="word " * 400_000), "prompt:"),
    (generate(messages=[text_pb2.ChatMessage(role="user", content=LONG * 200)]), "messages:"),
    (generate(prompt_token_ids=[1] * 1_000_000), "prompt:"),
    (
        lambda stack: stack.stub.ListPrompts(text_pb2.ListPromptsRequest(tenant_id=LONG)),
        "tenant_id:",
    ),
    (
        lambda stack: stack.stub.DeletePrompt(text_pb2.DeletePromptRequest(name=LONG)),
        "name:",
    ),
]


def test_oversized_input_is_refused_with_a_short_message(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            for call, prefix in OVERSIZED:
                error = await rpc_error(call(stack))  # type: ignore[arg-type]
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (prefix, error.details())
                assert error.details().startswith(prefix), error.details()
                assert len(error.details()) <= MAX_DETAILS, error.details()
            assert stack.engine.requests == []

    run(scenario)


def test_an_unknown_model_is_quoted_short(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            error = await rpc_error(
                stack.generate(text_pb2.GenerateRequest(prompt="hi", model="m" * 200))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details().startswith("model: unknown model 'mmm")
            assert "…" in error.details() and len(error.details()) <= MAX_DETAILS

    run(scenario)


def test_a_prompt_within_the_size_bound_is_tokenized(model: ServedModel) -> None:
    # Runs of spaces take many characters per token: a size bound of a few characters per
    # token would refuse this prompt, which fits.
    spaces = " " * (MAX_MODEL_LEN * 40)
    assert len(model.tokenizer.encode(spaces)) < MAX_MODEL_LEN

    async def scenario() -> None:
        async with running_stack(model, [FakeEngine(script_for([1]))]) as stack:
            await stack.generate(text_pb2.GenerateRequest(prompt=spaces))
            submitted = stack.engine.requests[0]
            assert list(submitted.prompt_token_ids) == model.tokenizer.encode(spaces)

    run(scenario)


@pytest.mark.parametrize(
    "text",
    [
        " " * 5000,
        "-" * 5000,
        "\n" * 5000,
        "<|im_start|>" * 500,
        "1234567890" * 500,
        "🦊日本語" * 1000,
        "e\u0301" * 2000,  # decomposed accents
    ],
)
def test_the_size_bound_never_refuses_what_fits(model: ServedModel, text: str) -> None:
    # Whatever the text, it has at least len(text) / max_chars_per_token tokens: a prompt over
    # max_prompt_chars cannot fit.
    num_tokens = len(model.tokenizer.encode(text, add_special_tokens=False))
    assert num_tokens * model.tokenizer.max_chars_per_token >= len(text)
    assert model.max_prompt_chars == MAX_MODEL_LEN * model.tokenizer.max_chars_per_token


# ---- the HTTP door --------------------------------------------------------------------------

OVERSIZED_BODIES: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    # (path, body, headers, the parameter named)
    ("chat/completions", {"messages": [{"role": "user", "content": LONG * 200}]}, {}, "messages"),
    ("completions", {"prompt": "word " * 400_000}, {}, "prompt"),
    ("completions", {"prompt": [1] * 1_000_000}, {}, "prompt"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt_name": LONG},
        {},
        "prompt_name",
    ),
    ("completions", {"prompt": "hi", "tenant_id": LONG}, {}, "tenant_id"),
    ("completions", {"prompt": "hi", "user": LONG}, {}, "user"),
    ("completions", {"prompt": "hi", "stop": [LONG]}, {}, "stop"),
    ("completions", {"prompt": "hi", LONG: 1}, {}, "n" * 63 + "…"),
    ("completions", {"prompt": "hi"}, {"X-Request-Id": "r" * 1000}, "X-Request-Id"),
]


def test_http_refuses_oversized_input_with_a_short_message(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            assert stack.server.http is not None
            base = f"http://127.0.0.1:{stack.server.http.port}/v1/"
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                for path, body, headers, param in OVERSIZED_BODIES:
                    response = await http.post(
                        base + path, json={"model": model.name, **body}, headers=headers
                    )
                    assert response.status_code == 400, (param, response.text[:300])
                    error = response.json()["error"]
                    assert error["param"] == param, error
                    assert len(error["message"]) <= MAX_DETAILS, error["message"]
                unknown = await http.post(
                    base + "completions", json={"model": "m" * 200, "prompt": "hi"}
                )
            assert stack.engine.requests == []
        assert unknown.status_code == 404
        assert len(unknown.json()["error"]["message"]) <= MAX_DETAILS

    run(scenario)
