"""The public edge of a real stack against hostile input: hand-built bytes that do not decode
or carry a field of the wrong wire type (gRPC), a 10 KB prompt name and a 2 MB prompt (both
doors). Each is refused as the client's fault, naming the field, with a short message, and
leaves one quiet line in the tokenizer's log, never a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack, running_stack
from tests.e2e.conftest import STACK_FLAGS, STARTUP_TIMEOUT_S
from tests.wire_bytes import LEN, VARINT, len_field, tag, varint

pytestmark = pytest.mark.slow

GENERATE = "/llmserve.v1.TextGeneration/Generate"
REGISTER_PROMPT = "/llmserve.v1.TextGeneration/RegisterPrompt"
BAD_UTF8 = b"hi\xff\xfe"
LONG_NAME = "n" * 10_000
HUGE_PROMPT = "word " * 400_000  # 2 MB
MAX_MESSAGE = 300
"""The most a refusal's message may take: it quotes a short prefix of the input at most."""
TIMEOUT_S = 60


@dataclass
class LoggedStack:
    stack: RunningStack
    log: Path

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.stack.public)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.stack.http}/{path}", json=body, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedStack]:
    log = tmp_path_factory.mktemp("edge") / "stack.log"
    with pytest.MonkeyPatch.context() as env:
        # INFO, so the one line each refusal leaves is there to be counted.
        env.setenv("LLMSERVE_LOG_LEVEL", "INFO")
        flags = [*STACK_FLAGS, "--tokenizer-replicas", "1"]
        with (
            log.open("wb") as stderr,
            running_stack(flags, startup_timeout_s=STARTUP_TIMEOUT_S, stderr=stderr) as stack,
        ):
            yield LoggedStack(stack, log)
    assert stack.returncode == 0


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> grpc.RpcError:
    """The error `data` (raw request bytes) gets; fails if the call succeeds."""
    try:
        if method == GENERATE:
            list(channel.unary_stream(method)(data, timeout=TIMEOUT_S))
        else:
            channel.unary_unary(method)(data, timeout=TIMEOUT_S)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{method} accepted {data[:40]!r}")


def chat_message(role: bytes, content: bytes) -> bytes:
    return len_field(1, role) + len_field(2, content)


MALFORMED = [
    # (method, request bytes, the field the message names first)
    (GENERATE, len_field(2, BAD_UTF8), "prompt:"),
    (
        GENERATE,
        len_field(3, chat_message(b"user", b"hi")) + len_field(3, chat_message(b"user", BAD_UTF8)),
        "messages[1].content:",
    ),
    (GENERATE, len_field(2, b"hi") + len_field(5, len_field(11, BAD_UTF8)), "sampling.stop[0]:"),
    (GENERATE, len_field(2, b"hi") + len_field(9, BAD_UTF8), "tenant_id:"),
    (GENERATE, tag(2, LEN) + varint(1000) + b"cut short", "prompt:"),
    # max_new_tokens as length-delimited: protobuf alone would run it with the default.
    (
        GENERATE,
        len_field(2, b"hi") + len_field(5, len_field(9, b"\x02")),
        "sampling.max_new_tokens:",
    ),
    (GENERATE, len_field(2, b"hi") + len_field(5, tag(9, VARINT)), "sampling.max_new_tokens:"),
    (REGISTER_PROMPT, len_field(1, BAD_UTF8) + len_field(2, b"Be brief."), "name:"),
]


@pytest.mark.parametrize(("method", "data", "prefix"), MALFORMED)
def test_malformed_requests_are_invalid_argument_naming_the_field(
    edge: LoggedStack, method: str, data: bytes, prefix: str
) -> None:
    with edge.channel() as channel:
        error = raw_call(channel, method, data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(prefix), error.details()
    assert len(error.details()) <= MAX_MESSAGE


def test_a_well_formed_request_still_generates(edge: LoggedStack) -> None:
    request = text_pb2.GenerateRequest(
        prompt="Hello", sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=2)
    )
    responses = list(edge.stack.text_stub().Generate(request, timeout=TIMEOUT_S))
    assert responses[-1].finish_reason in ("length", "stop")
    assert responses[-1].usage.completion_tokens <= 2


@pytest.mark.parametrize(
    ("request_", "prefix"),
    [
        (
            text_pb2.GenerateRequest(
                messages=[text_pb2.ChatMessage(role="user", content="hi")], prompt_name=LONG_NAME
            ),
            "prompt_name:",
        ),
        (text_pb2.GenerateRequest(prompt=HUGE_PROMPT), "prompt:"),
        (
            text_pb2.GenerateRequest(
                messages=[text_pb2.ChatMessage(role="user", content=HUGE_PROMPT)]
            ),
            "messages:",
        ),
        (text_pb2.GenerateRequest(prompt="hi", model=LONG_NAME), "model:"),
    ],
)
def test_grpc_refuses_oversized_input_with_a_short_message(
    edge: LoggedStack, request_: text_pb2.GenerateRequest, prefix: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(edge.stack.text_stub().Generate(request_, timeout=TIMEOUT_S))
    error: Any = info.value
    # Before, a 10 KB name came back whole: RESOURCE_EXHAUSTED "received metadata size
    # exceeds soft limit" on the client.
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()[:300]
    assert error.details().startswith(prefix)
    assert len(error.details()) <= MAX_MESSAGE


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_name": LONG_NAME},
            "prompt_name",
        ),
        ("completions", {"prompt": HUGE_PROMPT}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": HUGE_PROMPT}]}, "messages"),
    ],
)
def test_http_refuses_oversized_input_with_a_short_message(
    edge: LoggedStack, path: str, body: dict[str, Any], param: str
) -> None:
    model = httpx.get(f"{edge.stack.http}/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    response = edge.post(path, {"model": model, **body})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param
    assert len(error["message"]) <= MAX_MESSAGE


def test_refusals_leave_quiet_lines_and_no_traceback(edge: LoggedStack) -> None:
    # Runs last in this module: every malformed request has been sent by then.
    text = edge.log.read_text(errors="replace")
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    undecodable = [r for r in records if r["msg"] == "undecodable request"]
    assert len(undecodable) == len(MALFORMED)
    assert all(r["level"] == "info" and "exc" not in r for r in undecodable)
    # grpc.aio logs a deserializer's exception with its traceback: none may be there.
    tier = [r for r in records if r["logger"].startswith(("services.tokenizer", "grpc"))]
    assert not [r for r in tier if "exc" in r or r["level"] == "error"]
    assert "DecodeError" not in text
    assert LONG_NAME not in text
