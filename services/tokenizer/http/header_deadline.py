"""Uvicorn's HTTP/1.1 protocol (httptools) with a deadline and a size bound on a request's
headers: uvicorn bounds only the idle time between requests, so a client trickling its
headers a byte at a time (slowloris) would hold its connection forever.

    connect ──headers──▶ app (body: http_body_limits.py) ──response──▶ keep-alive idle ──▶ ...
    |<─ timeout_s ─>|                                                  |<─ uvicorn's ─>|

A connection that sent nothing by the deadline is closed; one that sent part of its headers
gets 408 first, headers over max_header_bytes 431. A deadline that passes while an earlier
response is still being written (a pipelined request) lets that response finish, then closes.
Those closes linger while the client is still sending (http_linger.py), so it reads the answer.
"""

from __future__ import annotations

import asyncio

from services.tokenizer.http.linger import LingeringCloseProtocol

MAX_HEADER_BYTES = 64 * 1024
"""Request line and headers together (nginx allows 4 x 8 KiB; an API call needs a few)."""


class HeaderDeadlineProtocol(LingeringCloseProtocol):
    header_timeout_s: float = 30.0
    max_header_bytes: int = MAX_HEADER_BYTES

    _deadline: asyncio.TimerHandle | None = None
    _reading_headers: bool = True
    _header_bytes: int = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._reading_headers and self._header_bytes > self.max_header_bytes:
            self._refuse(431, b"request headers larger than %d bytes" % self.max_header_bytes)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._reading_headers:  # the next request on a kept-alive connection
            self._reading_headers = True
            self._header_bytes = 0
            self._arm()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if not self._reading_headers or self.transport.is_closing():
            return
        if self._header_bytes == 0:
            self.transport.close()  # nothing to answer: a connection that never spoke
            return
        self._refuse(408, b"request headers not received within %g s" % self.header_timeout_s)

    def _refuse(self, status: int, message: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier response is being written: let it finish, read no more, then close.
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        reason = b"Request Timeout" if status == 408 else b"Request Header Fields Too Large"
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, reason, len(message), message)
        )
        self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn builds per connection, with this deadline."""
    attributes = {"header_timeout_s": timeout_s}
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), attributes)
