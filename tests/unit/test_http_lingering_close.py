"""The HTTP door's lingering close, against a real tokenizer tier (scripted scheduler) over
loopback sockets, on asyncio's loop and on uvloop (the one the process runs on): a body over
the limit sent whole, as urllib, httpx and the openai client send it, gets its 413 instead of
a reset; a client that keeps sending after the refusal is cut off within the linger's bounds;
an idle kept-alive connection still closes at once when the server stops, and so does a TLS
connection (TLS cannot half-close)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop

from services.tokenizer.http.linger import LINGER_MAX_BYTES, LINGER_S
from tests.tls_certs import self_signed
from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    Stack,
    running_stack,
    script_for,
    served_model,
)

MAX_BODY_BYTES = 2048
LIMITS: dict[str, Any] = {"http_max_body_bytes": MAX_BODY_BYTES, "http_timeout_s": 5.0}
WHOLE_BODY_BYTES = 4 * 1024 * 1024
"""More than loopback's socket buffers hold, so a server that closed unread would reset the
client mid-send; less than LINGER_MAX_BYTES, so the linger reads it all."""

LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def _run(loop: str, scenario: Callable[[], Awaitable[None]]) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(scenario(), 30))


def _engine() -> FakeEngine:
    return FakeEngine(script_for([5, 6], finish_reason="stop"))


def _url(stack: Stack, path: str) -> str:
    assert stack.server.http is not None
    return f"http://127.0.0.1:{stack.server.http.port}{path}"


def _oversized_json(model_name: str) -> bytes:
    return json.dumps({"model": model_name, "prompt": "x" * WHOLE_BODY_BYTES}).encode()


def _post_with_urllib(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _post_with_httpx(url: str, content: bytes | Iterator[bytes]) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    response = httpx.post(url, content=content, headers=headers, timeout=10)
    return response.status_code, response.json()


def _chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    """The body as an iterator: httpx sends it chunked (no Content-Length)."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def _no_connections_left(stack: Stack) -> None:
    assert stack.server.http is not None
    for _ in range(100):
        if stack.server.http.num_connections == 0:
            return
        await asyncio.sleep(0.02)
    assert stack.server.http.num_connections == 0


def _assert_too_large(status: int, body: dict[str, Any]) -> None:
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert str(MAX_BODY_BYTES) in body["error"]["message"]


@LOOPS
def test_a_whole_body_over_the_limit_gets_the_413_not_a_reset(loop: str) -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            url = _url(stack, "/v1/completions")
            body = _oversized_json(model.name)
            # Blocking clients, as users run them: in threads, so the server keeps serving.
            _assert_too_large(*await asyncio.to_thread(_post_with_urllib, url, body))
            _assert_too_large(*await asyncio.to_thread(_post_with_httpx, url, body))
            chunked = await asyncio.to_thread(_post_with_httpx, url, _chunks(body))
            _assert_too_large(*chunked)
            await _no_connections_left(stack)  # each client's close ended its linger
            assert stack.engine.requests == []

    _run(loop, scenario)


async def _refused_then_keep_sending(
    stack: Stack, write_size: int, pause_s: float
) -> tuple[bytes, float, int]:
    """Headers declaring a huge body, then `write_size` bytes every `pause_s` for as long as
    the server lets us; (the answer read, seconds from the answer to the server's last close,
    bytes sent after the answer)."""
    assert stack.server.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.server.http.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000000\r\n\r\n"
    )
    answer = await asyncio.wait_for(reader.read(), 5)  # the 413, then the half-close's EOF
    answered = time.perf_counter()
    chunk = b"x" * write_size
    sent = 0
    try:
        while stack.server.http.num_connections > 0 and time.perf_counter() - answered < 10:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
            await asyncio.sleep(pause_s)
    except ConnectionError:
        pass  # the server's close reset what we were still sending: expected
    await _no_connections_left(stack)
    elapsed = time.perf_counter() - answered
    writer.close()
    return answer, elapsed, sent


@LOOPS
def test_a_client_that_keeps_sending_is_cut_off_after_the_linger_time(loop: str) -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            # 4 KiB every 20 ms: far below LINGER_MAX_BYTES within LINGER_S.
            answer, elapsed, sent = await _refused_then_keep_sending(stack, 4096, 0.02)
            assert answer.startswith(b"HTTP/1.1 413"), answer
            assert LINGER_S / 2 <= elapsed < LINGER_S + 1.5, elapsed  # lingered, then cut
            assert sent < LINGER_MAX_BYTES

    _run(loop, scenario)


@LOOPS
def test_a_client_that_floods_is_cut_off_after_the_linger_bytes(loop: str) -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            answer, elapsed, sent = await _refused_then_keep_sending(stack, 256 * 1024, 0)
            assert answer.startswith(b"HTTP/1.1 413"), answer
            assert sent >= LINGER_MAX_BYTES
            assert elapsed < LINGER_S, elapsed  # cut off by size, before the time bound

    _run(loop, scenario)


@LOOPS
def test_an_idle_kept_alive_connection_closes_at_once_on_shutdown(loop: str) -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            assert stack.server.http is not None
            reader, writer = await asyncio.open_connection("127.0.0.1", stack.server.http.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"connection: close" not in head.lower()  # kept alive, now idle
            started = time.perf_counter()
            await stack.server.http.stop()
            elapsed = time.perf_counter() - started
            assert elapsed < LINGER_S / 2, elapsed  # a linger would wait for our EOF
            rest = await asyncio.wait_for(reader.read(), 1)
            assert b"HTTP/1.1" not in rest  # the body of /health at most, then EOF
            writer.close()

    _run(loop, scenario)


@LOOPS
def test_a_tls_connection_closes_at_once_after_a_refusal(loop: str, tmp_path: Path) -> None:
    model = served_model()
    cert, key = self_signed(tmp_path)
    client_tls = ssl.create_default_context(cafile=str(cert))

    async def scenario() -> None:
        tls = {"tls_cert": str(cert), "tls_key": str(key)}
        async with running_stack(model, [_engine()], **LIMITS, **tls) as stack:
            assert stack.server.http is not None
            port = stack.server.http.port
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
            )
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 413"), answer
            started = time.perf_counter()
            await _no_connections_left(stack)  # while this client still holds its side open
            assert time.perf_counter() - started < LINGER_S / 2
            writer.close()

    _run(loop, scenario)
