"""The Open Responses routes' logic: a request through the chat pipeline (generation.Generator),
its answer as a `response` object or its event stream, kept in the store when asked.

As the chat door: the request is checked, tokenized and routed, and a stream's status waits
for its first token, so a bad field (400) or a full queue (429) is a real status. An error
after that is one `error` event, then `response.failed`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.contracts.errors import LLMServeError, NotFoundError
from services.tokenizer import metrics
from services.tokenizer.access.keys import AccessPolicy, Caller
from services.tokenizer.generation import GenerationStream, Generator
from services.tokenizer.http.common import (
    ClientGone,
    collect,
    error_response,
    json_response,
    next_or_none,
    prepare_for_caller,
    rate_limit_headers,
    refused,
    unless_gone,
)
from services.tokenizer.http.openai.errors import http_error
from services.tokenizer.http.openai.responses import sse_event
from services.tokenizer.http.openai.responses_api import body as responses_body
from services.tokenizer.http.openai.responses_api.builder import ResponseObject, new_id
from services.tokenizer.http.openai.responses_api.store import ResponseStore, StoredResponse
from services.tokenizer.output import OutputDelta

log = logging.getLogger(__name__)


def owner(caller: Caller) -> str:
    """Whose stored responses a caller reads: its tenant's, else its key's."""
    return f"tenant:{caller.tenant_id}" if caller.tenant_id else f"key:{caller.key_id}"


class ResponsesDoor:
    def __init__(self, generator: Generator, access: AccessPolicy, store: ResponseStore) -> None:
        self.generator = generator
        self.access = access
        self.store = store

    async def create(self, request: Request) -> Response:
        arrival_unix_s = time.time()
        started = time.perf_counter()
        request_metrics = metrics.GenerateMetrics(started)
        response_id = new_id("resp")
        try:
            caller = self.access.authenticate(request.headers.get("authorization"))
            body = responses_body.parse(await request.body())
            items = responses_body.input_items(body)
            history: list[dict[str, Any]] = []
            if body.previous_response_id:
                previous = await self.store.get(owner(caller), body.previous_response_id)
                if previous is None:
                    raise NotFoundError(
                        "previous_response_id",
                        f"no stored response {body.previous_response_id!r}",
                    )
                history = previous.input_items + _as_input(previous.response["output"])
            generate_input = responses_body.generate_input(
                body,
                history + items,
                response_id,
                self.generator.limits.max_new_tokens_limit,
            )
            prepared = await prepare_for_caller(
                request,
                self.generator,
                generate_input,
                caller,
                arrival_unix_s=arrival_unix_s,
                started=started,
            )
        except (LLMServeError, ClientGone) as exc:
            return refused(exc, response_id, request_metrics, http_error)
        response = ResponseObject(response_id, _echo(body, prepared.request.lora_name or ""))
        if not response.echo["model"]:
            response.echo["model"] = self.generator.model.name
        stored_owner = owner(caller) if body.store is not False else None
        save = _Saver(self.store, stored_owner, history + items)
        stream = self.generator.stream(prepared)
        deltas = stream.deltas()
        headers = {"X-Request-Id": response_id, **rate_limit_headers(prepared.quota)}
        try:
            if not body.stream:
                await unless_gone(request, collect(deltas, response, request_metrics))
                request_metrics.done(None)
            else:
                first = await unless_gone(request, next_or_none(deltas))
        except (LLMServeError, ClientGone) as exc:
            stream.cancel()
            await deltas.aclose()  # type: ignore[attr-defined]
            return refused(exc, response_id, request_metrics, http_error)
        if not body.stream:
            answer = response.body(response.final_status)
            await save(answer)
            return json_response(answer, 200, **headers)
        events = _events(stream, deltas, first, response, request_metrics, save)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def retrieve(self, request: Request, response_id: str) -> Response:
        try:
            caller = self.access.authenticate(request.headers.get("authorization"))
            stored = await self.store.get(owner(caller), response_id)
            if stored is None:
                raise NotFoundError("response_id", f"no stored response {response_id!r}")
        except LLMServeError as exc:
            return error_response(http_error(exc))
        return json_response(stored.response)

    async def delete(self, request: Request, response_id: str) -> Response:
        try:
            caller = self.access.authenticate(request.headers.get("authorization"))
            if not await self.store.delete(owner(caller), response_id):
                raise NotFoundError("response_id", f"no stored response {response_id!r}")
        except LLMServeError as exc:
            return error_response(http_error(exc))
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


class _Saver:
    """Keeps a finished response (when the request asked for `store`)."""

    def __init__(self, store: ResponseStore, owner: str | None, items: list[dict[str, Any]]):
        self.store, self.owner, self.items = store, owner, items

    async def __call__(self, answer: dict[str, Any]) -> None:
        if self.owner is not None:
            await self.store.put(self.owner, StoredResponse(answer, self.items))


def _echo(body: responses_body.ResponsesBody, lora_name: str) -> dict[str, Any]:
    """The request fields a response object repeats."""
    fmt = body.text.format if body.text and body.text.format else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    tool_choice: Any = body.tool_choice or "auto"
    if not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return {
        "model": lora_name or body.model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tools": [tool.model_dump() for tool in body.tools or ()],
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store is not False,
        "text": text,
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "top_logprobs": 0,
        "background": False,
        "service_tier": "default",
        "max_tool_calls": None,
        "prompt_cache_key": None,
        "safety_identifier": None,
    }


def _as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the next turn's input (reasoning dropped)."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return items


async def _events(
    stream: GenerationStream,
    deltas: AsyncIterator[OutputDelta],
    first: OutputDelta | None,
    response: ResponseObject,
    request_metrics: metrics.GenerateMetrics,
    save: _Saver,
) -> AsyncIterator[bytes]:
    code: str | None = None
    try:
        out = b"".join(_sse(event) for event in response.start())
        delta = first
        while delta is not None:
            request_metrics.on_tokens(len(delta.token_ids))
            out += b"".join(_sse(event) for event in response.events(delta))
            if delta.finish_reason:
                request_metrics.finish_reason = delta.finish_reason
            if delta.ends_stream:
                break
            if out:
                yield out
                out = b""
            delta = await anext(deltas, None)
        final = response.finish()
        await save(final["response"])
        yield out + _sse(final)
    except LLMServeError as exc:
        error = http_error(exc)
        code = error.grpc_code_name
        log.info("stream failed", extra={"request_id": response.response_id, "error": str(exc)})
        detail = error.body()["error"]
        failed = response.body("failed")
        failed["error"] = {"code": detail["code"] or "server_error", "message": detail["message"]}
        yield _sse(response.event("error", error=detail)) + _sse(
            response.event("response.failed", response=failed)
        )
    finally:
        stream.cancel()
        await deltas.aclose()  # type: ignore[attr-defined]
        request_metrics.done(code)


def _sse(event: dict[str, Any]) -> bytes:
    """A named SSE event (`event: <type>`), as the spec's streams carry them."""
    return b"event: " + str(event["type"]).encode() + b"\n" + sse_event(event)
