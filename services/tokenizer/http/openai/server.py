"""Uvicorn on the replica's own event loop (no second process, no thread): the HTTP door shares
the scheduler channels, the tokenizer and the metrics of the gRPC door.

The listening socket is opened here with SO_REUSEPORT, as grpc opens its own: replicas started
on one host share the HTTP port as they share the gRPC port, the kernel spreading connections
across them. Uvicorn's signal handling is left out: the process's drain (GrpcService) owns
SIGTERM and stops both doors.

Connections are bounded in number (uvicorn's limit_concurrency: 503 beyond it) and in how long
their headers may take (http_header_deadline.py); bodies by the app's middleware
(http_body_limits.py). A connection closed with its request still arriving lingers
(http_linger.py), so the client reads the refusal rather than a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator
from typing import Any

import uvicorn

from services.tokenizer.http.header_deadline import header_deadline_protocol

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def listening_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class HttpServer:
    """An ASGI app served on host:port (TLS when a certificate and key are given)."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        drain_s: float = 30.0,
        timeout_s: float = 30.0,
        max_connections: int | None = None,
    ) -> None:
        """`timeout_s`: how long a request's headers may take; `max_connections`: most open
        connections served at once (None: no bound)."""
        self.host = host
        self._socket = listening_socket(host, port)
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            timeout_graceful_shutdown=max(drain_s, 0.1),
            # Streams of tokens: no reason to hold a small write back (Nagle is off in
            # uvicorn's protocols already); keep-alive long enough for a client between calls.
            timeout_keep_alive=30,
            http=header_deadline_protocol(timeout_s),
            # Uvicorn refuses a request when its connection count (this one included) reaches
            # the limit: one more admits exactly max_connections.
            limit_concurrency=None if max_connections is None else max_connections + 1,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def num_connections(self) -> int:
        """Connections open now (each holds a socket and its buffers)."""
        return len(self._server.server_state.connections)

    async def start(self) -> int:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.host}:{self.port} stopped at start")
            await asyncio.sleep(0.01)
        log.info("http listening", extra={"host": self.host, "port": self.port})
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (up to drain_s), then close."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        await self._task
