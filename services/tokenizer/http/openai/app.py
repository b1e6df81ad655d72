"""The OpenAI-compatible HTTP door of the tokenizer tier (FastAPI): the same pipeline as gRPC
Generate (generation.Generator), the same keys (access.AccessPolicy).

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /v1/models/{id}
    (API key when set)
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter   (admin key: lora_routes.py)
    POST /v1/responses  GET|DELETE /v1/responses/{id}   (Open Responses: responses_api/)
    GET /health                 liveness: the process answers
    GET /ready                  the tier can serve: model loaded, a scheduler with a worker

A request is checked, tokenized and routed before any byte of the response, and a stream's
status waits for its first token, so a full queue (429), no worker (503), a deadline (504) or
a bad field (400) is a real status, never an error inside a 200 stream. An error after that
(the scheduler went away mid-stream) is sent as one `data: {"error": ...}` event, then
`data: [DONE]`, as vLLM does.

A client that disconnects cancels its request: a stream's body generator is cancelled by the
server; a non-streaming request watches the connection while it waits. Either way the scheduler
call ends, and the scheduler frees the KV blocks at once.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.contracts.errors import (
    DependencyUnavailableError,
    LLMServeError,
    NotFoundError,
    quoted,
)
from services.tokenizer import metrics
from services.tokenizer.access.keys import AccessPolicy
from services.tokenizer.generation import GenerationStream, Generator, Prepared
from services.tokenizer.http.common import (
    ClientGone,
    answer_start,
    error_response,
    json_response,
    prepare_for_caller,
    rate_limit_headers,
    refused,
)
from services.tokenizer.http.openai import schemas
from services.tokenizer.http.openai.errors import HttpError, http_error, not_found_route
from services.tokenizer.http.openai.prompt_batch import BatchStream, prepare_batch
from services.tokenizer.http.openai.responses import (
    DONE_EVENT,
    CompletionPrompt,
    ResponseBuilder,
    model_list,
    sse_event,
)
from services.tokenizer.output import OutputDelta
from services.tokenizer.validation import GenerateInput

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


class OpenAIDoor:
    """The routes' logic, over the tier's generator and keys."""

    def __init__(self, generator: Generator, access: AccessPolicy) -> None:
        self.generator = generator
        self.access = access
        self.started = int(time.time())

    def ready(self) -> bool:
        clients = self.generator.pool.clients
        return self.generator.loaded and any(c.stats is not None for c in clients)

    @functools.cached_property
    def _token_text(self) -> Callable[[int], str]:
        tokenizer = self.generator.model.tokenizer

        @functools.lru_cache(maxsize=65536)
        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        return token_text

    async def models(self, request: Request) -> Response:
        try:
            return json_response(self._model_list(request))
        except LLMServeError as exc:
            return error_response(http_error(exc))

    async def model(self, request: Request, model_id: str) -> Response:
        """One entry of the list (the openai client's `models.retrieve()`); 404 if unknown."""
        try:
            for entry in self._model_list(request)["data"]:
                if entry["id"] == model_id:
                    return json_response(entry)
            raise NotFoundError("model", f"no model {quoted(model_id)} is served")
        except LLMServeError as exc:
            return error_response(http_error(exc))

    def _model_list(self, request: Request) -> dict[str, Any]:
        self.access.authenticate(request.headers.get("authorization"))
        model = self.generator.model
        adapters = self.generator.adapters.listed(model.name)
        return model_list(model.name, self.started, adapters, max_model_len=model.max_model_len)

    async def generate(self, request: Request, chat: bool) -> Response:
        arrival_unix_s = time.time()
        started = time.perf_counter()
        request_metrics = metrics.GenerateMetrics(started)
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            caller = self.access.authenticate(request.headers.get("authorization"))
            model = self.generator.model
            raw = await request.body()
            if chat:
                chat_body = schemas.parse_chat(raw)
                body: schemas.ChatCompletionBody | schemas.CompletionBody = chat_body
                inputs = [
                    schemas.chat_input(
                        chat_body, request_id, self.generator.limits.max_new_tokens_limit
                    )
                ]
                top_logprobs = (chat_body.top_logprobs or 0) if chat_body.logprobs else None
            else:
                completion_body = schemas.parse_completion(raw)
                body = completion_body
                inputs = schemas.completion_inputs(completion_body, request_id)
                top_logprobs = completion_body.logprobs
            batch = await prepare_batch(
                inputs,
                lambda generate_input: prepare_for_caller(
                    request,
                    self.generator,
                    generate_input,
                    caller,
                    arrival_unix_s=arrival_unix_s,
                    started=started,
                ),
            )
        except (LLMServeError, ClientGone) as exc:
            return refused(
                exc, request_id, request_metrics, functools.partial(http_error, chat=chat)
            )
        prepared = batch[0]
        if len(batch) == 1:
            request_id = prepared.request.request_id
        if body.user:
            log.info("end user", extra={"request_id": request_id, "user": body.user[:128]})
        builder = ResponseBuilder(
            chat=chat,
            request_id=request_id,
            # The name the client sent: an adapter's, else the served model's.
            model=prepared.request.lora_name or model.name,
            token_text=self._token_text,
            top_logprobs=top_logprobs,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            return_token_ids=body.return_token_ids,
            prompt_token_ids=tuple(prepared.request.prompt_token_ids),
            n=prepared.request.sampling.n,
            prompts=() if chat else self._prompts(inputs, batch, body),
        )
        streams = [self.generator.stream(item) for item in batch]
        stream: GenerationStream | BatchStream = streams[0]
        if len(streams) > 1:
            stream = BatchStream(streams, prepared.request.sampling.n)
        deltas = stream.deltas()
        headers = {"X-Request-Id": request_id, **rate_limit_headers(prepared.quota)}
        try:
            # The status waits for the first token (see the module docstring).
            first = await answer_start(
                request, stream, deltas, builder, request_metrics, body.stream
            )
        except (LLMServeError, ClientGone) as exc:
            return refused(
                exc, request_id, request_metrics, functools.partial(http_error, chat=chat)
            )
        if not body.stream:
            return json_response(builder.response(), **headers)
        events = _events(stream, deltas, first, builder, request_metrics, chat)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _prompts(
        self,
        inputs: list[GenerateInput],
        batch: list[Prepared],
        body: schemas.ChatCompletionBody | schemas.CompletionBody,
    ) -> tuple[CompletionPrompt, ...]:
        """A completions request's prompts as its choices show them: each one's token ids,
        and with echo its text (a prompt sent as ids: their text)."""
        echo = isinstance(body, schemas.CompletionBody) and body.echo
        tokenizer = self.generator.model.tokenizer
        return tuple(
            CompletionPrompt(
                token_ids=tuple(prepared.request.prompt_token_ids),
                echo=(
                    (
                        generate_input.prompt
                        or tokenizer.decode(
                            list(prepared.request.prompt_token_ids), skip_special_tokens=False
                        )
                    )
                    if echo
                    else None
                ),
            )
            for generate_input, prepared in zip(inputs, batch, strict=True)
        )


async def _events(
    stream: GenerationStream | BatchStream,
    deltas: AsyncIterator[OutputDelta],
    first: OutputDelta | None,
    builder: ResponseBuilder,
    request_metrics: metrics.GenerateMetrics,
    chat: bool,
) -> AsyncIterator[bytes]:
    """The stream's bytes: one write per delta (its chunks, and [DONE] with the last)."""
    code: str | None = None
    try:
        head = b"".join(sse_event(chunk) for chunk in builder.first_chunks()) if chat else b""
        delta = first
        while delta is not None:
            request_metrics.on_tokens(len(delta.token_ids))
            out = head + b"".join(sse_event(chunk) for chunk in builder.chunks(delta))
            head = b""
            if delta.finish_reason:
                request_metrics.finish_reason = delta.finish_reason
            if delta.ends_stream:
                yield out + DONE_EVENT
                return
            if out:
                yield out
            delta = await anext(deltas, None)
    except LLMServeError as exc:
        error = http_error(exc, chat)
        code = error.grpc_code_name
        log.info("stream failed", extra={"request_id": builder.request_id, "error": str(exc)})
        yield sse_event(error.body()) + DONE_EVENT
    finally:
        stream.cancel()
        await deltas.aclose()
        request_metrics.done(code)


def create_app(door: OpenAIDoor) -> FastAPI:
    app = FastAPI(
        title="llmserve",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(not_found_route(request.method, request.url.path))
        return error_response(HttpError(exc.status_code, str(exc.detail), "invalid_request_error"))

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if door.ready():
            return json_response({"status": "ready"})
        return error_response(http_error(DependencyUnavailableError("no scheduler can serve yet")))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await door.models(request)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await door.model(request, model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await door.generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await door.generate(request, chat=False)

    return app
