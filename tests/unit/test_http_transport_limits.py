"""The HTTP door of a real tokenizer tier (scripted scheduler) against clients that misbehave
on the wire: bodies over the limit (413 before they are read), headers and bodies trickled a
byte at a time (closed within --http-timeout-s), more connections than --http-max-connections
(503). After each, the replica holds no stray connection and still serves."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from tests.unit.tokenizer_tier_harness import (
    FakeEngine,
    Stack,
    run,
    running_stack,
    script_for,
    served_model,
)

MAX_BODY_BYTES = 2048
TIMEOUT_S = 1.5
TRICKLE_S = 0.5
LIMITS: dict[str, Any] = {"http_max_body_bytes": MAX_BODY_BYTES, "http_timeout_s": TIMEOUT_S}


def _engine() -> FakeEngine:
    return FakeEngine(script_for([5, 6], finish_reason="stop"))


async def _connect(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert stack.server.http is not None
    return await asyncio.open_connection("127.0.0.1", stack.server.http.port)


def _head(path: str, **headers: str | int) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _parse(raw: bytes) -> tuple[int, dict[str, Any] | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


async def _served(stack: Stack, model_name: str) -> None:
    """The replica answers a normal request, and the misbehaving connections are gone."""
    assert stack.server.http is not None
    url = f"http://127.0.0.1:{stack.server.http.port}/v1/completions"
    async with httpx.AsyncClient(timeout=10) as client:
        ok = await client.post(url, json={"model": model_name, "prompt": "hi"})
    assert ok.status_code == 200, ok.text
    for _ in range(50):
        if stack.server.http.num_connections == 0:
            break
        await asyncio.sleep(0.02)
    assert stack.server.http.num_connections == 0


def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            for path, anthropic in (("/v1/chat/completions", False), ("/v1/messages", True)):
                reader, writer = await _connect(stack)
                # Headers only: a server that waited for the 10 MB would never answer.
                writer.write(_head(path, content_length=10_000_000))
                raw = await asyncio.wait_for(reader.read(), 5)
                writer.close()
                status, body = _parse(raw)
                assert status == 413 and body is not None, raw
                if anthropic:
                    assert body["type"] == "error"
                    assert body["error"]["type"] == "invalid_request_error"  # the schema's type
                    message = body["error"]["message"]
                else:
                    assert body["error"]["code"] == "request_too_large"
                    message = body["error"]["message"]
                assert str(MAX_BODY_BYTES) in message
            await _served(stack, model.name)
            assert len(stack.engine.requests) == 1

    run(scenario)


def test_a_chunked_body_is_read_no_further_than_the_limit() -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            reader, writer = await _connect(stack)
            writer.write(_head("/v1/completions", transfer_encoding="chunked"))
            chunk = b"x" * 512
            sent = 0
            raw = b""
            for _ in range(64):  # 32 KiB on offer; the server must stop after 2 KiB
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                sent += len(chunk)
                try:
                    raw = await asyncio.wait_for(reader.read(), 0.2)
                except TimeoutError:
                    continue
                break
            writer.close()
            status, body = _parse(raw)
            assert status == 413 and body is not None, raw
            assert sent <= MAX_BODY_BYTES + 2 * len(chunk)
            assert str(MAX_BODY_BYTES) in body["error"]["message"]
            await _served(stack, model.name)

    run(scenario)


async def _trickle(stack: Stack, prefix: bytes, payload: bytes) -> tuple[float, bytes]:
    """Sends `prefix` at once, then `payload` a byte every TRICKLE_S until the server closes;
    (seconds until the close, what the server sent)."""
    reader, writer = await _connect(stack)
    started = time.perf_counter()
    writer.write(prefix)

    async def drip() -> None:
        for byte in payload:
            await asyncio.sleep(TRICKLE_S)
            writer.write(bytes([byte]))

    dripping = asyncio.create_task(drip())
    try:
        raw = await asyncio.wait_for(reader.read(), TIMEOUT_S + 5)
    finally:
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        writer.close()
    return time.perf_counter() - started, raw


def test_trickled_headers_and_bodies_are_cut_off_at_the_timeout() -> None:
    model = served_model()
    body = json.dumps({"model": "x", "prompt": "hi"}).encode()
    head = _head("/v1/completions", content_length=len(body))

    async def scenario() -> None:
        async with running_stack(model, [_engine()], **LIMITS) as stack:
            headers, body_trickle, silent = await asyncio.gather(
                _trickle(stack, b"", head),
                _trickle(stack, head, body),
                _trickle(stack, b"", b""),
            )
            for elapsed, _ in (headers, body_trickle, silent):
                assert TIMEOUT_S - 0.1 <= elapsed < TIMEOUT_S + 1.5, elapsed
            assert _parse(headers[1])[0] == 408, headers[1]
            status, error = _parse(body_trickle[1])
            assert status == 408 and error is not None, body_trickle[1]
            assert error["error"]["type"] == "timeout"
            assert silent[1] == b""  # a connection that never spoke is closed unanswered
            await _served(stack, model.name)
            assert len(stack.engine.requests) == 1

    run(scenario)


def test_connections_over_the_cap_get_503_until_one_closes() -> None:
    model = served_model()

    async def scenario() -> None:
        async with running_stack(model, [_engine()], http_max_connections=2) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/health"
            held = [await _connect(stack) for _ in range(2)]
            for reader, writer in held:  # two kept-alive connections, each served once
                writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200"), head
            async with httpx.AsyncClient(timeout=5) as client:
                refused = await client.get(url)
                assert refused.status_code == 503
                held.pop()[1].close()
                await asyncio.sleep(0.1)
                assert (await client.get(url)).status_code == 200
            for _, writer in held:
                writer.close()

    run(scenario)
