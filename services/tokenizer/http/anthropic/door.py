"""The Anthropic Messages API door of the tokenizer tier: the same pipeline as the other doors
(generation.Generator), the same keys and tenants (access.AccessPolicy), on the OpenAI door's
app and port.

    POST /v1/messages               a message, whole or as Anthropic's stream of events
    POST /v1/messages/count_tokens  {"input_tokens": N}: the prompt after the chat template

The key comes as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`; the
`anthropic-version` and `anthropic-beta` headers are not read. As at the OpenAI door
(openai_http/app.py), a request is checked, tokenized and routed before any byte of the
response and a stream's status waits for its first token, so a refusal is a real status; an
error after that is one `error` event, which ends the stream. A client that disconnects
cancels its request.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from services.contracts.errors import LLMServeError, UnauthenticatedError
from services.tokenizer import metrics
from services.tokenizer.access.keys import AccessPolicy, Caller
from services.tokenizer.generation import GenerationStream, Generator
from services.tokenizer.http.anthropic import schemas
from services.tokenizer.http.anthropic.errors import AnthropicError, anthropic_error, route_error
from services.tokenizer.http.anthropic.responses import Event, MessageBuilder, sse
from services.tokenizer.http.common import (
    ClientGone,
    answer_start,
    error_response,
    json_response,
    prepare_for_caller,
    rate_limit_headers,
    refused,
)
from services.tokenizer.http.openai.app import REQUEST_ID_HEADER
from services.tokenizer.output import OutputDelta
from services.tokenizer.validation import check_prompt_size, validate_model

log = logging.getLogger(__name__)

API_KEY_HEADER = "x-api-key"
MESSAGE_ID_PREFIX = "msg_"


class AnthropicDoor:
    """The routes' logic, over the tier's generator and keys."""

    def __init__(self, generator: Generator, access: AccessPolicy) -> None:
        self.generator = generator
        self.access = access

    def authenticate(self, request: Request) -> Caller:
        key = request.headers.get(API_KEY_HEADER)
        if key:
            return self.access.authenticate_key(key)
        authorization = request.headers.get("authorization")
        if not authorization and not self.access.open:
            raise UnauthenticatedError(
                "missing API key: send it as 'x-api-key: <key>' or 'Authorization: Bearer <key>'"
            )
        return self.access.authenticate(authorization)

    async def messages(self, request: Request) -> Response:
        arrival_unix_s = time.time()
        started = time.perf_counter()
        request_metrics = metrics.GenerateMetrics(started)
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            caller = self.authenticate(request)
            model = self.generator.model
            body = schemas.parse_messages(await request.body())
            generate_input = schemas.messages_input(body, request_id)
            # The Messages API has no tenant parameter: a bound key's tenant, else none.
            prepared = await prepare_for_caller(
                request,
                self.generator,
                generate_input,
                caller,
                arrival_unix_s=arrival_unix_s,
                started=started,
            )
        except (LLMServeError, ClientGone) as exc:
            return refused(exc, request_id, request_metrics, _error_for(request_id))
        request_id = prepared.request.request_id
        if body.metadata is not None and body.metadata.user_id:
            log.info("end user", extra={"request_id": request_id, "user": body.metadata.user_id})
        builder = MessageBuilder(
            MESSAGE_ID_PREFIX + request_id,
            prepared.request.lora_name or model.name,
            body.max_tokens,
            show_thinking=schemas.thinking_enabled(body, model.reasoning_parser),
        )
        stream = self.generator.stream(prepared)
        deltas = stream.deltas()
        # Anthropic's clients read `request-id`; ours (and the OpenAI door) `X-Request-Id`.
        headers = {
            "X-Request-Id": request_id,
            "request-id": request_id,
            **rate_limit_headers(prepared.quota),
        }
        try:
            # The status waits for the first token (see the module docstring).
            first = await answer_start(
                request, stream, deltas, builder, request_metrics, body.stream
            )
        except (LLMServeError, ClientGone) as exc:
            return refused(exc, request_id, request_metrics, _error_for(request_id))
        if not body.stream:
            return json_response(builder.response(), **headers)
        # The first scheduler output has told how much of the prompt the cache held.
        start = builder.message_start(
            len(prepared.request.prompt_token_ids), stream.output.progress.num_cached_tokens
        )
        events = _events(stream, deltas, first, start, builder, request_metrics, request_id)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def count_tokens(self, request: Request) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            self.authenticate(request)
            model, limits = self.generator.model, self.generator.limits
            body = schemas.parse_count_tokens(await request.body())
            generate_input = schemas.count_tokens_input(body)
            # An adapter shares the served model's tokenizer: its count is the same.
            adapters = await self.generator.adapters.names_for(generate_input.model, model.name)
            validate_model(generate_input.model, limits.model_name, adapters)
            # Refuses text too long for any context before tokenizing it; a prompt that
            # merely overflows the context is counted (the client asked how long it is).
            check_prompt_size(generate_input, limits)
            tool_request = generate_input.tool_request
            token_ids = model.tokenizer.apply_chat_template(
                generate_input.messages,
                tools=tool_request.template_tools()
                if tool_request and tool_request.tools
                else None,
                continue_final_message=generate_input.continue_final_message,
            )
        except LLMServeError as exc:
            error = anthropic_error(exc, request_id)
            log.info("rejected", extra={"status": error.status, "error": error.message})
            return error_response(error)
        return json_response({"input_tokens": len(token_ids)}, **{"request-id": request_id})


def _error_for(request_id: str) -> Callable[[BaseException], AnthropicError]:
    return functools.partial(anthropic_error, request_id=request_id)


async def _events(
    stream: GenerationStream,
    deltas: AsyncIterator[OutputDelta],
    first: OutputDelta | None,
    start: Event,
    builder: MessageBuilder,
    request_metrics: metrics.GenerateMetrics,
    request_id: str,
) -> AsyncIterator[bytes]:
    """The stream's bytes: message_start with the first delta's events, then one write per
    delta (the last ends with message_stop)."""
    code: str | None = None
    try:
        head = [start]
        delta = first
        while delta is not None:
            request_metrics.on_tokens(len(delta.token_ids))
            if delta.finish_reason:
                request_metrics.finish_reason = delta.finish_reason
            out = b"".join(sse(event) for event in [*head, *builder.events(delta)])
            head = []
            if delta.ends_stream:
                yield out
                return
            if out:
                yield out
            delta = await anext(deltas, None)
    except LLMServeError as exc:
        error = anthropic_error(exc, request_id)
        code = error.grpc_code_name
        log.info("stream failed", extra={"request_id": builder.message_id, "error": str(exc)})
        yield sse(("error", error.body()))
    finally:
        stream.cancel()
        await deltas.aclose()
        request_metrics.done(code)


PATH_PREFIX = "/v1/messages"


def serves(path: str) -> bool:
    """Whether a path is this door's (its errors take Anthropic's shape)."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def add_anthropic_routes(app: FastAPI, door: AnthropicDoor) -> None:
    """The Messages API's routes on the tier's HTTP app (beside the OpenAI door's)."""

    @app.post(PATH_PREFIX)
    async def messages(request: Request) -> Response:
        return await door.messages(request)

    @app.post(f"{PATH_PREFIX}/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await door.count_tokens(request)

    # An unknown route or method under this door's path answers in Anthropic's error shape;
    # any other path keeps the app's own answer (the OpenAI door's).
    app_handler = app.exception_handlers[HTTPException]

    async def route_refused(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, HTTPException) or not serves(request.url.path):
            return await app_handler(request, exc)
        error = route_error(
            exc.status_code, request.method, request.url.path, dict(exc.headers or {})
        )
        return error_response(error)

    app.add_exception_handler(HTTPException, route_refused)
