"""Open Responses request bodies → the chat pipeline's GenerateInput.

Pure. The body is checked by its own pydantic model (an unknown or wrong-typed field: 400
naming it), then its input items become chat messages, its function tools and tool_choice the
chat door's ToolRequest and `text.format` the structured output, so one pipeline serves both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from services.contracts.errors import InvalidRequestError
from services.tokenizer.http.common import validated_body
from services.tokenizer.http.openai import schemas
from services.tokenizer.validation import GenerateInput


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    """An assistant message's label in the history: accepted, not part of the prompt."""


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Body):
    """An earlier answer's reasoning, sent back: accepted, left out of the prompt (as the chat
    door does with reasoning_content)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(item: Any) -> str:
    """An item's type; a message may leave it out (the spec's "easy" input message)."""
    if isinstance(item, dict):
        kind = item.get("type", "message")
        return kind if isinstance(kind, str) else ""
    return str(getattr(item, "type", ""))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionToolBody(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None


class ResponsesBody(_Body):
    model: schemas.ModelName
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[FunctionToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    store: bool | None = None
    stream: schemas.Flag = False
    previous_response_id: str | None = None
    user: schemas.EndUser | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    """Extra output the caller asks for: only empty (see parse)."""
    tenant_id: schemas.TenantId | None = None


def parse(raw: bytes) -> ResponsesBody:
    body = validated_body(ResponsesBody, raw)
    if body.metadata is not None and len(body.metadata) > 16:
        raise InvalidRequestError("metadata", "at most 16 keys")
    if body.include:
        # Nothing extra (logprobs, encrypted reasoning...) is produced: refused, not ignored.
        raise InvalidRequestError("include", "is not supported")
    if body.tool_choice not in (None, "none") and not body.tools:
        raise InvalidRequestError("tool_choice", "needs tools")
    return body


def input_items(body: ResponsesBody) -> list[dict[str, Any]]:
    """The body's input as items (a string is one user message), as stored and chained."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(by_alias=True, exclude_none=True) for item in body.input]


def generate_input(
    body: ResponsesBody,
    items: list[dict[str, Any]],
    request_id: str,
    max_new_tokens_limit: int,
) -> GenerateInput:
    """The chat request the items (prior turns first) make, through the chat door's schema."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages.extend(_messages(items))
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "tenant_id": body.tenant_id,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None and body.tools:
        chat["tool_choice"] = body.tool_choice
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    if not messages:
        raise InvalidRequestError("input", "must not be empty")
    chat_body = schemas.ChatCompletionBody.model_validate(chat)
    return schemas.chat_input(chat_body, request_id, max_new_tokens_limit)


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join one assistant turn."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])}
            )
        # Reasoning items: left out of the prompt (see ReasoningItem).
    return messages


def _text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _response_format(body: ResponsesBody) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format.schema", "is required for json_schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "", "schema": fmt.schema_}}
