"""The public gRPC door against requests no well-behaved client sends: bytes that do not
decode, fields of the wrong wire type, oversized identifiers and prompts. Real gRPC on
loopback with raw bytes, the fake scheduler of test_tokenizer_server."""

from __future__ import annotations

import logging

import grpc
import pytest

from protos.llmserve.v1 import text_pb2
from services.tokenizer.server import ServedModel
from tests.unit.test_tokenizer_server import (
    TIMEOUT_S,
    Stack,
    rpc_error,
    run,
    running_stack,
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
