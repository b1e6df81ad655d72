"""One way to run a gRPC server for every service: grpc.aio on uvloop, the standard health
service (SERVING only once warmed up), reflection, and a SIGTERM drain. An internal service
(scheduler, worker: `GrpcService.internal`) also requires the stack's secret on every call but
health and reflection (services/common/internal_auth.py).

Shutdown: on SIGTERM/SIGINT health turns NOT_SERVING, the server stops accepting calls (new
ones get UNAVAILABLE), in-flight streams have `drain_s` seconds to finish, then `serve()`
returns and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.common.internal_auth import server_interceptors

log = logging.getLogger(__name__)

# Prompts of a few hundred thousand token ids exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC core times a keepalive ping out after ping_timeout_ms (default 60 s), whatever
    # keepalive_timeout_ms says: without it a peer that stops answering (a hung process, a
    # host gone) was dropped after ~70 s, not ~15 s (measured, grpcio 1.85). The worker frees
    # its single controller slot on that drop.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Our own clients ping every 10 s to notice a dead peer fast; without these the server counts
# those pings as abuse and closes the connection (GOAWAY "too_many_pings").
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]

# Trailing metadata of a refused call: rejection_reason() of the error, for the caller to
# tell apart refusals that share a status code (queue_full vs prompt_too_long).
REASON_METADATA_KEY = "llmserve-reason"
# With queue_full or rate_limited: milliseconds to wait before retrying. gRPC's own key (gRFC
# A6 "pushback"): a client whose service config retries RESOURCE_EXHAUSTED waits exactly this
# long before its next attempt instead of its own backoff, and any other client can read it as
# a hint.
RETRY_PUSHBACK_METADATA_KEY = "grpc-retry-pushback-ms"


class GrpcService:
    """A grpc.aio server with health and reflection for the given service names."""

    def __init__(
        self,
        name: str,
        service_names: list[str],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.name = name
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [
                *service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        self.port = 0
        self._stopping = asyncio.Event()

    @classmethod
    def internal(
        cls, name: str, service_names: list[str], internal_secret: str | None
    ) -> GrpcService:
        """A service only the stack calls: with a secret, every call but health and reflection
        must carry it (UNAUTHENTICATED otherwise); without one the port is open, and an INFO
        line says so."""
        return cls(name, service_names, server_interceptors(name, internal_secret))

    def add(self, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> None:
        add_to_server(servicer, self.server)

    async def start(
        self, host: str, port: int, credentials: grpc.ServerCredentials | None = None
    ) -> int:
        """Bind host:port (TLS only, with `credentials`) and start answering."""
        address = f"{host}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"{self.name}: cannot bind {host}:{port}")
        await self.server.start()
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        return self.port

    async def set_serving(self, serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._set_status(status)

    async def _set_status(self, status: Any) -> None:
        for service in ["", *self.service_names]:
            await self.health.set(service, status)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def wait_for_signal(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self._stopping.wait()

    async def drain_and_stop(
        self, drain_s: float, before_stop: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        log.info("draining", extra={"service": self.name, "drain_s": drain_s})
        await self.set_serving(False)
        if before_stop is not None:
            await before_stop()
        await self.server.stop(grace=drain_s)


def run_service(serve: Callable[[], Awaitable[None]]) -> int:
    """Run a service's `serve()` to completion on uvloop; the process exit code."""
    install_uvloop()
    asyncio.run(serve())  # type: ignore[arg-type]
    return 0


def install_uvloop() -> None:
    """uvloop where it is available: grpc.aio runs on it and its loop is faster."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from our typed errors to gRPC status codes."""
    from services.contracts.errors import (
        AlreadyExistsError,
        CapacityError,
        ConflictError,
        DeadlineExceededError,
        DependencyUnavailableError,
        InternalError,
        InvalidRequestError,
        LLMServeError,
        NotFoundError,
        PermissionDeniedError,
        QueueFullError,
        RateLimitedError,
        UnauthenticatedError,
    )

    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AlreadyExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, ConflictError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, DependencyUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, (QueueFullError, CapacityError, RateLimitedError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, DeadlineExceededError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, InternalError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, LLMServeError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def refusal_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a call refused with `exc`: its reason, and for a full queue (when
    the scheduler estimated one) or a key over its limit the retry pushback."""
    from services.contracts.errors import QueueFullError, RateLimitedError

    metadata = ((REASON_METADATA_KEY, rejection_reason(exc)),)
    if isinstance(exc, (QueueFullError, RateLimitedError)) and exc.retry_after_ms is not None:
        metadata += ((RETRY_PUSHBACK_METADATA_KEY, str(exc.retry_after_ms)),)
    return metadata


def retry_pushback_ms(metadata: Mapping[str, str | bytes]) -> int | None:
    """The retry pushback in a refused call's trailing metadata; None when absent or not a
    non-negative integer (gRPC reads those as "do not retry": no hint to pass on)."""
    value = metadata.get(RETRY_PUSHBACK_METADATA_KEY)
    if not isinstance(value, str) or not (value.isascii() and value.isdigit()):
        return None
    return int(value)


def rejection_reason(exc: BaseException) -> str:
    """A short, bounded metric label for a request refused with `exc` (never the message)."""
    from services.contracts.errors import (
        CapacityError,
        PromptTooLongError,
        QueueFullError,
        RateLimitedError,
    )

    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, RateLimitedError):
        return "rate_limited"
    if isinstance(exc, (CapacityError, PromptTooLongError)):
        return "prompt_too_long"
    return str(status_for(exc)[0].name).lower()  # invalid_argument, not_found, internal, ...
