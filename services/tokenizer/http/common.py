"""What the tier's HTTP doors (OpenAI, Anthropic) share: a request body parsed and validated,
its error named as the client spells the parameter, waiting on work while watching the client's
connection, a refused request's response and log line, and a whole answer's collection."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from services.contracts.errors import InvalidRequestError, LLMServeError, quoted, shortened
from services.tokenizer import metrics
from services.tokenizer.access.keys import Caller, acting_for
from services.tokenizer.access.limits import Quota
from services.tokenizer.generation import Generator, Prepared
from services.tokenizer.http.json_body import parse_json_body
from services.tokenizer.output import OutputDelta
from services.tokenizer.validation import MAX_REQUEST_ID_LEN, GenerateInput

log = logging.getLogger(__name__)

T = TypeVar("T")
BodyT = TypeVar("BodyT", bound=BaseModel)
ItemT = TypeVar("ItemT")

# A tagged union's failure (an image block where only text and tool blocks are taken) is
# reported on the item; the client reads it best as the item's `type`.
_UNION_TAG_ERRORS = frozenset({"union_tag_invalid", "union_tag_not_found"})


class ClientGone(Exception):
    """The client closed the connection while its request waited."""


class ErrorAnswer(Protocol):
    """A door's error, in its own shape."""

    @property
    def status(self) -> int: ...
    @property
    def message(self) -> str: ...
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def grpc_code_name(self) -> str: ...
    def body(self) -> dict[str, Any]: ...


class Cancellable(Protocol):
    """A request's scheduler calls (GenerationStream, or a door's several of them)."""

    def cancel(self) -> None: ...


class DeltaSink(Protocol):
    """A whole answer being built."""

    def add(self, delta: OutputDelta) -> None: ...


def rate_limit_headers(quota: Quota | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for a key with rpm or tpm limits (none without)."""
    return {} if quota is None else quota.headers()


def json_response(payload: dict[str, Any], status: int = 200, **headers: str) -> Response:
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(error: ErrorAnswer) -> Response:
    return json_response(error.body(), error.status, **error.headers)


def refused(
    exc: BaseException,
    request_id: str,
    request_metrics: metrics.GenerateMetrics,
    error_for: Callable[[BaseException], ErrorAnswer],
) -> Response:
    """The response to a request refused before its first byte (499 when the client left),
    logged and counted."""
    if isinstance(exc, ClientGone):
        log.info("client went away", extra={"request_id": request_id})
        request_metrics.done(None)
        return Response(status_code=499)
    error = error_for(exc)
    log.info(
        "rejected",
        extra={
            "request_id": request_id[:MAX_REQUEST_ID_LEN],
            "status": error.status,
            "error": error.message,
        },
    )
    metrics.on_rejected(exc)
    request_metrics.done(error.grpc_code_name)
    return error_response(error)


async def answer_start(
    request: Request,
    stream: Cancellable,
    deltas: AsyncIterator[OutputDelta],
    sink: DeltaSink,
    request_metrics: metrics.GenerateMetrics,
    streaming: bool,
) -> OutputDelta | None:
    """What decides a response's status, before its first byte: a whole answer collected into
    `sink` (None), or a stream's first delta. A client that leaves (ClientGone) or an error
    (LLMServeError) cancels the scheduler call first, then propagates."""
    try:
        if not streaming:
            await unless_gone(request, collect(deltas, sink, request_metrics))
            request_metrics.done(None)
            return None
        return await unless_gone(request, next_or_none(deltas))
    except (LLMServeError, ClientGone):
        stream.cancel()
        await deltas.aclose()  # type: ignore[attr-defined]
        raise


async def collect(
    deltas: AsyncIterator[OutputDelta], sink: DeltaSink, request_metrics: metrics.GenerateMetrics
) -> None:
    """A whole (non-streamed) answer: every delta into `sink`, counted."""
    async for delta in deltas:
        request_metrics.on_tokens(len(delta.token_ids))
        request_metrics.finish_reason = delta.finish_reason or request_metrics.finish_reason
        sink.add(delta)


def validated_body(model: type[BodyT], raw: bytes) -> BodyT:
    """A door's body: checked JSON (json_body), then its schema. Strict: a number is not a
    string, a boolean is not a number (lax coercion would turn `"max_tokens": true` into 1)."""
    value = parse_json_body(raw)
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as exc:
        raise body_error(exc) from None


def body_error(exc: ValidationError) -> InvalidRequestError:
    """The first of the deepest errors, its parameter as a path (`messages[1].role`). A value
    that fits no member of a union gets an error per member; the one that got furthest into
    the value says most (an image part: `messages[0].content[0].type`, not "should be a
    string")."""
    error = max(exc.errors(include_url=False), key=lambda error: len(error["loc"]))
    if error["type"] == "json_invalid":
        return InvalidRequestError("", f"the body is not valid JSON: {error['msg']}")
    if error["type"] == "model_type" and not error["loc"]:
        return InvalidRequestError("", "the body must be a JSON object")
    # A parameter's name is the client's own text when it is one we do not know.
    param = shortened(body_param(error["loc"]), 64)
    if error["type"] == "extra_forbidden":
        return InvalidRequestError(param, f"unsupported parameter {quoted(param)}")
    if error["type"] == "missing":
        return InvalidRequestError(param, f"{param!r} is required")
    if error["type"] in _UNION_TAG_ERRORS:
        item = error["input"]
        kind = item.get("type") if isinstance(item, dict) else None
        what = quoted(kind) if isinstance(kind, str) else "a missing or non-string type"
        return InvalidRequestError(f"{param}.type", f"{what} is not supported here")
    return InvalidRequestError(param, shortened(error["msg"], 200))


def body_param(loc: tuple[int | str, ...]) -> str:
    """('messages', 1, 'role') → 'messages[1].role'. Union members appear in pydantic's
    location as type names ('str', 'list[int]') and tagged-union members by their tags
    (named with a space by our schemas, so never identifiers); they are not part of the
    parameter."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


async def next_or_none(items: AsyncIterator[ItemT]) -> ItemT | None:
    return await anext(items, None)


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) when the client disconnects
    first: a request waiting in a queue or generating for a client who left must not hold
    its place or its KV blocks."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # let its cleanup run
    raise ClientGone


async def prepare_for_caller(
    request: Request,
    generator: Generator,
    generate_input: GenerateInput,
    caller: Caller,
    *,
    arrival_unix_s: float,
    started: float,
) -> Prepared:
    """What every door does before its first byte: the request as the caller's key may send
    it (`acting_for`), checked, tokenized and routed; ClientGone if the client leaves first."""
    return await unless_gone(
        request,
        generator.prepare(
            acting_for(generate_input, caller),
            arrival_unix_s=arrival_unix_s,
            started=started,
            caller=caller,
        ),
    )


async def _disconnected(request: Request) -> None:
    # The body is read already: the next message the server has for us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
