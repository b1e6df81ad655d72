"""A lingering close for the HTTP door (nginx's lingering_close): a connection closed while its
request may still be arriving is half-closed instead, and what the client still sends is read
and thrown away until it closes its side.

Closing a TCP socket with unread input sends RST, and a client still writing (urllib, httpx and
the openai client send a whole body before they read; a slow client trickles its headers) can
lose the 413 or 408 already sent to it: its next read or write fails with a reset instead.

    answer ──write_eof (FIN)──▶ read, discard ──▶ client EOF | LINGER_S | LINGER_MAX_BYTES ──▶ close

An idle kept-alive connection, or one whose request was read whole, closes at once: nothing
can be unread, and a server stopping must not wait on idle pooled connections. TLS cannot
half-close (close_notify ends both directions), so a TLS connection closes at once as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

LINGER_S = 3.0
"""Longest a refused client may keep sending: enough to finish writing a body of a few MiB on a
LAN and read the answer; short, since the connection holds a slot (--http-max-connections) and
a stopping server waits for it. nginx allows 30 s; our bodies are bounded JSON."""

LINGER_MAX_BYTES = 16 * 1024 * 1024
"""Most bytes thrown away before closing: four times the default body limit, so a client over
the limit by as much again still sees its 413; past it, a fast client is cut off before
LINGER_S (on a fast link the time bound alone would read GBs for nothing)."""


class LingeringTransport(asyncio.Transport):
    """The connection's transport as the protocol and uvicorn's request cycles hold it: close()
    lingers while `input_pending()` says the client may still be sending."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        input_pending: Callable[[], bool],
    ) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._input_pending = input_pending
        self._deadline: asyncio.TimerHandle | None = None
        self._num_discarded_bytes = 0
        self.lingering = False

    def close(self) -> None:
        if self.lingering:
            return  # a second close (the server stopping): the linger's own bounds end it
        transport = self._transport
        # TLS transports cannot write EOF (close_notify ends both directions): they close at
        # once, as before, and a client still sending may see a reset.
        if transport.is_closing() or not self._input_pending() or not transport.can_write_eof():
            transport.close()
            return
        try:
            transport.write_eof()  # the answer already written goes first, then FIN
        except OSError:  # the client reset first (shutdown(2) on a reset socket: ENOTCONN)
            transport.close()
            return
        self.lingering = True
        # Uvicorn pauses reading while a body waits for the app or a pipelined request queues.
        transport.resume_reading()
        self._deadline = self._loop.call_later(LINGER_S, self._end)

    def discard(self, data: bytes) -> None:
        """Input that arrived while lingering: counted, never parsed. (The client's EOF closes
        the transport by itself: the protocol's eof_received asks for no half-open state.)"""
        self._num_discarded_bytes += len(data)
        if self._num_discarded_bytes > LINGER_MAX_BYTES:
            self._end()

    def cancel_deadline(self) -> None:
        """The connection is gone (or going): no timer may outlive it."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _end(self) -> None:
        self.cancel_deadline()
        self._transport.close()

    def is_closing(self) -> bool:
        # Lingering counts as closed: uvicorn and the header deadline then write nothing more.
        return self.lingering or self._transport.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.lingering:  # after close() nothing more is sent, as on a closed transport
            self._transport.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    # The rest is the real transport's.

    def write_eof(self) -> None:
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def abort(self) -> None:
        self.cancel_deadline()
        self._transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


class LingeringCloseProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol over a LingeringTransport. A request's input may be unread
    from its first byte (on_message_begin) until the parser has it whole (on_message_complete)."""

    _linger: LingeringTransport
    _input_pending: bool = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._linger = LingeringTransport(transport, self.loop, lambda: self._input_pending)
        super().connection_made(self._linger)

    def connection_lost(self, exc: Exception | None) -> None:
        self._linger.cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger.lingering:
            # Never parsed: the connection serves no more requests, and a parser that already
            # failed (400) or a body already refused must not be fed the rest.
            self._linger.discard(data)
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._input_pending = True
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._input_pending = False
        super().on_message_complete()
