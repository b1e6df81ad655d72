"""The public TextGeneration servicer registered with strict request decoding
(services.common.request_decoding): a request that does not decode, or that carries a field of
the wrong wire type, is answered INVALID_ARGUMENT naming the field, with one INFO log line.

Why not the generated add_TextGenerationServicer_to_server: grpc.aio takes a deserializer
that raises for a servicer failure (grpcio 1.85): the client gets UNKNOWN with the parser's
text, and the log an error-level traceback per request, which any client could use to flood
it. So the deserializer here never raises: it hands the handler an Undecodable in place of the
request, and the handler refuses it before the servicer method runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from protos.llmserve.v1 import text_pb2
from services.common.grpc_server import status_for
from services.common.request_decoding import decode_request
from services.contracts.errors import InvalidRequestError
from services.tokenizer import metrics

log = logging.getLogger(__name__)

TEXT_GENERATION = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"]

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Any]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the handler receives in place of a request that did not decode."""

    error: InvalidRequestError


def add_text_generation_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """What text_pb2_grpc.add_TextGenerationServicer_to_server does, with strict decoding."""
    add_strict_servicer(servicer, server, TEXT_GENERATION)


def add_strict_servicer(servicer: Any, server: grpc.aio.Server, service: Any) -> None:
    """Registers `servicer`'s methods for `service` (a ServiceDescriptor); the method table
    comes from the descriptor, as the generated code's does."""
    handlers = {
        method.name: _handler(method, getattr(servicer, method.name)) for method in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _handler(method: Any, behaviour: Behaviour) -> grpc.RpcMethodHandler:
    if method.client_streaming:
        raise ValueError(f"{method.full_name}: client-streaming methods are not supported")
    request_class = message_factory.GetMessageClass(method.input_type)

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return decode_request(request_class, data)
        except InvalidRequestError as exc:
            return Undecodable(exc)

    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(method.name, behaviour),
            request_deserializer=deserialize,
            response_serializer=_serialize,
        )
    return grpc.unary_unary_rpc_method_handler(
        _unary(method.name, behaviour),
        request_deserializer=deserialize,
        response_serializer=_serialize,
    )


def _unary(
    name: str, behaviour: Behaviour
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(name, request.error, context)
        return await behaviour(request, context)

    return handle


def _streaming(
    name: str, behaviour: Behaviour
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    # grpc.aio runs a streaming handler as a stream only when it is an async generator
    # function, so this one re-yields the servicer's responses (~0.1 us a message).
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _refuse(name, request.error, context)
        async with contextlib.aclosing(behaviour(request, context)) as responses:
            async for response in responses:
                yield response

    return handle


async def _refuse(
    name: str, error: InvalidRequestError, context: grpc.aio.ServicerContext
) -> NoReturn:
    log.info("undecodable request", extra={"method": name, "error": str(error)})
    metrics.on_rejected(error)
    await context.abort(*status_for(error))
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker


def _serialize(message: Message) -> bytes:
    data: bytes = message.SerializeToString()
    return data
