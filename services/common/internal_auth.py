"""The stack's internal secret on gRPC. Internal servers (scheduler, worker) refuse, with
UNAUTHENTICATED, every call that does not carry it; internal clients (tokenizer → scheduler,
scheduler → worker, the test and benchmark harness) send it as metadata.

    llmserve-internal-secret: <secret>          (gRPC metadata of every internal call)

Without it, anyone who reaches an internal port could submit raw token ids under another
tenant's cache salt (reading that tenant's prefix cache), or open a Step stream on a worker.

Health and reflection stay open: container and Kubernetes probes cannot send metadata, a health
answer is one word (SERVING or not), and reflection describes only the protos this repository
publishes; neither reads nor changes any state.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from services.common.shared_secret import SharedSecret

log = logging.getLogger(__name__)

INTERNAL_SECRET_KEY = "llmserve-internal-secret"
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
_OPEN_PREFIXES = tuple(f"/{name}/" for name in OPEN_SERVICES)

Metadata = tuple[tuple[str, str], ...]


def internal_metadata(secret: str | None) -> Metadata:
    """The metadata an internal call carries (none when the stack runs without a secret)."""
    return ((INTERNAL_SECRET_KEY, secret),) if secret else ()


def presented_secret(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == INTERNAL_SECRET_KEY:
            return value if isinstance(value, str) else None
    return None


class InternalSecretInterceptor(grpc.aio.ServerInterceptor):
    """Lets through calls that carry the secret (and health and reflection); answers every
    other call UNAUTHENTICATED before its handler runs."""

    def __init__(self, secret: SharedSecret) -> None:
        self.secret = secret

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        presented = presented_secret(handler_call_details.invocation_metadata)
        if self.secret.matches(presented):
            return handler
        reason = "missing" if presented is None else "invalid"
        return _refusal(handler, method, reason)


def _refusal(handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the refused method's shape that aborts at once. It takes the request as raw
    bytes: nothing an unauthenticated caller sends is ever parsed."""
    # The message never echoes what was presented.
    message = f"{reason} internal secret (metadata {INTERNAL_SECRET_KEY}): {method} is internal"

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        log.warning(
            "internal call refused",
            extra={"method": method, "peer": context.peer(), "reason": reason},
        )
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(request, context)
        yield  # never reached: makes this an async generator, as a streaming handler is

    serialize = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, None, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, None, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, None, serialize)
    return grpc.unary_unary_rpc_method_handler(refuse, None, serialize)


def server_interceptors(service: str, secret: str | None) -> list[grpc.aio.ServerInterceptor]:
    """What an internal server installs: the secret check, or nothing (and an INFO line saying
    the port is open) when no secret is configured."""
    if not secret:
        log.info(
            "no internal secret configured: this internal port trusts anyone who reaches it",
            extra={"service": service},
        )
        return []
    shared = SharedSecret(secret)
    log.info(
        "internal calls need the stack's secret", extra={"service": service, "secret_id": shared.id}
    )
    return [InternalSecretInterceptor(shared)]


class _AddSecret:
    def __init__(self, secret: str) -> None:
        self._metadata = internal_metadata(secret)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *self._metadata)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined,no-any-return]


# One class per kind of call: grpc.aio files an interceptor under the first kind it is an
# instance of, so one class deriving from all four would only ever see unary-unary calls.
class _UnaryUnary(_AddSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AddSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AddSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


def client_interceptors(secret: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the secret to every call made on a channel, so no call site can
    forget it (none without a secret)."""
    if not secret:
        return []
    return [kind(secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def internal_channel(
    address: str, secret: str | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A plaintext channel whose every call carries the stack's secret."""
    interceptors = client_interceptors(secret) or None
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
