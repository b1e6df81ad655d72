"""An ASGI middleware in front of the HTTP doors: a request body is read here, bounded in size
(413) and in time (408), before any route sees it, then handed to the app whole.

A body that says it is not JSON (its Content-Type) is refused with 415; none is read as
JSON. A Content-Length over the limit is refused before a byte of the body is read; a chunked body
is read until it passes the limit, no further. Either refusal, and a timeout, close the
connection: what is left of the body is never parsed (the close lingers, throwing it away for a
bounded time so the client reads the answer: http_linger.py). (The headers' own deadline is the
HTTP protocol's: http_header_deadline.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.tokenizer.http.common import ErrorAnswer, error_response

ErrorShape = Callable[[str, int, str], ErrorAnswer]
"""(path, status, message) → the error in the shape of the door that serves the path."""


class BodyLimits:
    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int, timeout_s: float, error_for: ErrorShape
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.error_for = error_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refused_by_headers(scope)
        if refusal is not None:
            await self._answer(scope, receive, send, *refusal)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.timeout_s)
        except TimeoutError:
            message = f"the request body was not received within {self.timeout_s:g} s"
            await self._answer(scope, receive, send, 408, message)
            return
        if body is None:
            return  # the client left: nobody to answer
        if len(body) > self.max_body_bytes:
            await self._answer(scope, receive, send, 413, self._too_large())
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    def _refused_by_headers(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) for a Content-Length that is bad or over the limit, or a body
        that says it is not JSON (every body the doors take is)."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    return 400, "the Content-Length header is not a number"
                if int(value) > self.max_body_bytes:
                    return 413, self._too_large()
            elif name == b"content-type" and scope.get("method") == "POST":
                media_type = value.split(b";")[0].strip().lower()
                if media_type != b"application/json" and not media_type.endswith(b"+json"):
                    shown = media_type.decode("latin-1")[:64]
                    return 415, f"the Content-Type must be application/json, got {shown!r}"
        return None

    def _too_large(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes"

    async def _read_body(self, receive: Receive) -> bytearray | None:
        """The body, or as much as passes the limit; None when the client disconnects."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes or not message.get("more_body", False):
                return body

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, status: int, message: str
    ) -> None:
        error = self.error_for(str(scope.get("path", "")), status, message)
        response = error_response(error)
        # The rest of the body is never parsed: the connection cannot carry another request.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the server's own messages (the disconnect a waiting
    request watches for: http_common.unless_gone)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
