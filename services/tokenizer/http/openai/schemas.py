"""OpenAI request bodies (/v1/chat/completions, /v1/completions) → the tier's GenerateInput.

Pure: JSON in, plain data out, InvalidRequestError naming the parameter at fault out of a bad
body. Every parameter a body may carry is declared: one we do not know, or one we know but do
not implement given a value that would change the result (suffix, best_of > 1), is refused
with 400 naming it, never silently ignored. A known parameter at its "off" value (null)
is accepted: many clients send those by default. `n` (1..16) asks for that many choices
of each prompt.

Completions' `prompt`: a string, a list of token ids, or a batch (a list of strings, or of
token-id lists; at most MAX_PROMPTS), one GenerateInput per prompt; `echo`
prepends each prompt to its choices (responses.py).

Defaults follow OpenAI and vLLM: temperature 1, top_p 1; max_tokens unset = the rest of the
context for chat, 16 for completions. Beyond OpenAI: vLLM's top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, allowed_token_ids and
return_token_ids, and ours: deadline_ms, num_speculative_tokens, prompt_name (a registered
prompt as the system message) and tenant_id (what the gRPC API calls them).

Structured output: chat's `response_format` (json_schema, json_object), and on both endpoints
vLLM's `structured_outputs` ({"json" | "regex" | "grammar" | "json_object": ...}) and its older
`guided_json`, `guided_regex`, `guided_grammar`; at most one of them per request.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from services.contracts.errors import InvalidRequestError, quoted, shortened
from services.contracts.sampling_params import logit_bias_from_json
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.text.chat_template import ChatMessage, MessageToolCall, TextPart
from services.tokenizer.http.common import validated_body
from services.tokenizer.tool_request import FunctionTool, ToolChoiceMode, ToolRequest
from services.tokenizer.validation import (
    MAX_MODEL_NAME_LEN,
    MAX_PROMPT_NAME_LEN,
    MAX_TENANT_ID_LEN,
    GenerateInput,
    SamplingInput,
)

MAX_LOGPROBS = 20
MAX_DEADLINE_MS = 2**32 - 1
"""As the gRPC door's uint32 (49 days)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default for the legacy completions endpoint."""
MAX_PROMPTS = 32
"""Most prompts in one completions request: each is a scheduler request of its own (with n
choices), so a batch takes up to MAX_PROMPTS * n of a scheduler's seats and queue."""


def _null_is_false(value: object) -> object:
    return False if value is None else value


Flag = Annotated[bool, BeforeValidator(_null_is_false)]
"""A boolean parameter that may also be sent as null, meaning false (OpenAI's are nullable)."""

# Identifiers, bounded as the gRPC door bounds them (validation.py); `user` is the caller's
# id for its end user, only logged.
ModelName = Annotated[str, Field(max_length=MAX_MODEL_NAME_LEN)]
TenantId = Annotated[str, Field(max_length=MAX_TENANT_ID_LEN)]
PromptName = Annotated[str, Field(max_length=MAX_PROMPT_NAME_LEN)]
EndUser = Annotated[str, Field(max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class StreamOptions(_Body):
    include_usage: Flag = False
    """One more chunk before [DONE] with usage and no choices."""


class TextContentPart(_Body):
    """A `{"type": "text"}` part of an OpenAI message's content."""

    type: Literal["text"]
    text: str


class FunctionCallBody(_Body):
    name: str
    arguments: str
    """JSON text, as the API returned it."""


class ToolCallBody(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: None = None
    """Accepted only absent or null: our chat templates have no participant names."""
    tool_calls: list[ToolCallBody] | None = None
    """An assistant message's calls (the history of a tool-calling conversation)."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""
    reasoning_content: str | None = None
    """An earlier answer's reasoning, as we returned it: accepted and left out of the prompt
    (reasoning models' templates drop past thinking, and so does vLLM)."""


class FunctionBody(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(_Body):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Body):
    """Parameters both endpoints share."""

    model: ModelName
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    """Token ids as strings → bias in [-100, 100]; the keys are parsed in `_sampling`."""
    user: EndUser | None = None
    """The end user, for the caller's own records: logged with the request, nothing else."""
    stream: Flag = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    """Choices of the one prompt, 1..16 (checked with the other sampling fields)."""
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: Flag = False
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    return_token_ids: bool = False
    """Each choice (and stream chunk) also carries the generated token ids."""
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # Ours, as the gRPC API names them.
    deadline_ms: Annotated[int, Field(ge=0, le=MAX_DEADLINE_MS)] | None = None
    tenant_id: TenantId | None = None
    num_speculative_tokens: int | None = None
    """Speculative decoding by n-gram lookup: most draft tokens per step, 0 = off, null = the
    server's default (range checked with the other sampling fields)."""


class ChatCompletionBody(_Sampling):
    messages: Annotated[list[ChatMessageBody], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Flag = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_name: PromptName | None = None
    response_format: dict[str, Any] | None = None
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Flag = False
    suffix: str | None = None
    best_of: int | None = None


BodyT = TypeVar("BodyT", "ChatCompletionBody", "CompletionBody")


def parse_chat(body: bytes) -> ChatCompletionBody:
    return _parse(ChatCompletionBody, body)


def parse_completion(body: bytes) -> CompletionBody:
    return _parse(CompletionBody, body)


def _parse(model: type[BodyT], body: bytes) -> BodyT:
    parsed = validated_body(model, body)
    _refuse_unimplemented(parsed)
    return parsed


def _refuse_unimplemented(body: _Sampling) -> None:
    if body.stream_options is not None and not body.stream:
        # As vLLM: options for a stream that is not asked for are a caller's mistake.
        raise InvalidRequestError("stream_options", "needs stream: true")
    if isinstance(body, ChatCompletionBody):
        if body.tool_choice not in (None, "none") and not body.tools:
            raise InvalidRequestError("tool_choice", "needs tools")
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    if isinstance(body, CompletionBody):
        if body.suffix:
            raise InvalidRequestError("suffix", "is not supported")
        if body.best_of is not None and body.best_of != 1:
            raise InvalidRequestError("best_of", "only best_of = 1 is supported")


# ---- structured output --------------------------------------------------------------------

_STRUCTURED_OUTPUTS_KEYS = {
    "json": StructuredOutputKind.JSON_SCHEMA,
    "regex": StructuredOutputKind.REGEX,
    "grammar": StructuredOutputKind.GRAMMAR,
    "json_object": StructuredOutputKind.JSON_OBJECT,
}


def structured_output(body: _Sampling) -> tuple[StructuredOutput | None, str]:
    """The body's structured-output request and the parameter that carried it (errors of its
    compile name that parameter); (None, "") when it has none. Two of them: 400."""
    found: list[tuple[StructuredOutput, str]] = []
    if isinstance(body, ChatCompletionBody) and body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if body.structured_outputs:
        found.append(_structured_outputs(body.structured_outputs))
    if body.guided_json is not None:
        found.append((_json_schema(body.guided_json, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        found.append(
            (StructuredOutput(StructuredOutputKind.REGEX, body.guided_regex), "guided_regex")
        )
    if body.guided_grammar is not None:
        found.append(
            (StructuredOutput(StructuredOutputKind.GRAMMAR, body.guided_grammar), "guided_grammar")
        )
    if len(found) > 1:
        raise InvalidRequestError(
            found[1][1], f"only one structured output per request; {found[0][1]} is set too"
        )
    return found[0] if found else (None, "")


# The keys OpenAI's schema allows for each response_format type; others are refused by name,
# as unknown fields are everywhere else in the door (a misspelt `schema` is not silently dropped).
_RESPONSE_FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type"},
    "json_schema": {"type", "json_schema"},
}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    allowed = _RESPONSE_FORMAT_KEYS.get(kind) if isinstance(kind, str) else None
    if allowed is not None:
        _refuse_unknown_keys(value, allowed, "response_format")
    wrapper = value.get("json_schema")
    if kind == "json_schema" and isinstance(wrapper, dict):
        _refuse_unknown_keys(wrapper, _JSON_SCHEMA_KEYS, "response_format.json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT)
    if kind == "json_schema":
        wrapper = value.get("json_schema")
        if not isinstance(wrapper, dict):
            raise InvalidRequestError(
                "response_format.json_schema", "must be an object with a 'schema'"
            )
        if "schema" not in wrapper:
            raise InvalidRequestError("response_format.json_schema.schema", "is required")
        return _json_schema(wrapper["schema"], "response_format.json_schema.schema")
    raise InvalidRequestError(
        "response_format.type",
        f"must be 'text', 'json_object' or 'json_schema', got {quoted(str(kind))}",
    )


def _refuse_unknown_keys(value: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in value:
        if key not in allowed:
            raise InvalidRequestError(
                f"{where}.{shortened(str(key), 32)}",
                f"is not a known field (known: {', '.join(sorted(allowed))})",
            )


def _structured_outputs(value: dict[str, Any]) -> tuple[StructuredOutput, str]:
    given = [key for key, item in value.items() if item is not None and item is not False]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs", f"set exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}"
        )
    key = given[0]
    param = f"structured_outputs.{shortened(key, 32)}"
    kind = _STRUCTURED_OUTPUTS_KEYS.get(key)
    if kind is None:
        raise InvalidRequestError(
            param, f"is not supported (supported: {', '.join(_STRUCTURED_OUTPUTS_KEYS)})"
        )
    item = value[key]
    if kind is StructuredOutputKind.JSON_SCHEMA:
        return _json_schema(item, param), param
    if kind is StructuredOutputKind.JSON_OBJECT:
        if item is not True:
            raise InvalidRequestError(param, "must be true")
        return StructuredOutput(kind), param
    if not isinstance(item, str):
        raise InvalidRequestError(param, "must be a string")
    return StructuredOutput(kind, item), param


def _json_schema(schema: object, param: str) -> StructuredOutput:
    """A schema sent as a JSON object (or as its text, as vLLM also accepts)."""
    if isinstance(schema, str):
        return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, schema)
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(param, "must be a JSON Schema object")
    return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema))


# ---- → GenerateInput --------------------------------------------------------------------


def chat_input(
    body: ChatCompletionBody, request_id: str, max_new_tokens_limit: int
) -> GenerateInput:
    messages = tuple(_message(m, index) for index, m in enumerate(body.messages))
    max_tokens = body.max_completion_tokens or body.max_tokens
    # OpenAI's chat default: as long as the context allows (the scheduler ends the sequence
    # with "length" when it fills).
    logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    return GenerateInput(
        request_id=request_id,
        messages=messages,
        sampling=_sampling(body, max_tokens or max_new_tokens_limit, logprobs, body.logprobs),
        deadline_ms=body.deadline_ms or 0,
        model=body.model,
        prompt_name=body.prompt_name or "",
        tenant_id=body.tenant_id or "",
        tool_request=tool_request(body),
    )


def tool_request(body: ChatCompletionBody) -> ToolRequest | None:
    """The body's tools and choice; None without tools (a choice of none needs none)."""
    if not body.tools:
        return None
    tools = tuple(
        FunctionTool(
            name=tool.function.name,
            description=tool.function.description or "",
            parameters=tool.function.parameters or {},
            strict=bool(tool.function.strict),
        )
        for tool in body.tools
    )
    choice, name = ToolChoiceMode.AUTO, ""
    if isinstance(body.tool_choice, NamedToolChoice):
        choice, name = ToolChoiceMode.FUNCTION, body.tool_choice.function.name
    elif body.tool_choice is not None:
        choice = ToolChoiceMode(body.tool_choice)
    parallel = body.parallel_tool_calls is not False
    return ToolRequest(tools, choice, name, parallel)


def completion_inputs(body: CompletionBody, request_id: str) -> list[GenerateInput]:
    """One input per prompt (a batch: request ids `<id>-<i>`, the scheduler's keys)."""
    prompts = _prompts(body.prompt)
    sampling = _sampling(
        body,
        body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
        body.logprobs or 0,
        body.logprobs is not None,
    )
    return [
        GenerateInput(
            request_id=batch_request_id(request_id, index, len(prompts)),
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            deadline_ms=body.deadline_ms or 0,
            model=body.model,
            tenant_id=body.tenant_id or "",
        )
        for index, (prompt, prompt_token_ids) in enumerate(prompts)
    ]


def batch_request_id(request_id: str, prompt_index: int, num_prompts: int) -> str:
    """A prompt's own request id (the scheduler's key); a single prompt keeps the request's."""
    return request_id if num_prompts == 1 else f"{request_id}-{prompt_index}"


def _sampling(
    body: _Sampling, max_new_tokens: int, top_logprobs: int, wants_logprobs: bool
) -> SamplingInput:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    spec, spec_param = structured_output(body)
    return SamplingInput(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_new_tokens=max_new_tokens,
        min_new_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logit_bias=logit_bias_from_json(body.logit_bias),
        # vLLM refuses an empty list rather than read it as "no restriction"; so does
        # validation (SamplingParams), so [] stays distinct from null here.
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        # The scheduler reports a token's logprob along with at least one alternative; a
        # request for none gets that one dropped on the way out (responses.py).
        logprobs=max(top_logprobs, 1) if wants_logprobs else 0,
        n=body.n,
        structured_output=spec,
        structured_output_param=spec_param,
        num_speculative_tokens=body.num_speculative_tokens,
    )


def _message(message: ChatMessageBody, index: int) -> ChatMessage:
    """A history message. An assistant message that made calls may have no content; a tool
    message names the call it answers."""
    calls = tuple(
        MessageToolCall(call.id, call.function.name, call.function.arguments)
        for call in message.tool_calls or ()
    )
    if calls and message.role != "assistant":
        raise InvalidRequestError(f"messages[{index}].tool_calls", "only assistant messages")
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequestError(f"messages[{index}].tool_call_id", "is required")
    if message.tool_call_id and message.role != "tool":
        raise InvalidRequestError(f"messages[{index}].tool_call_id", "only tool messages")
    content: str | tuple[TextPart, ...] = ""
    if message.content is not None or not calls:
        content = _content(message.content, index)
    return ChatMessage(
        role=_role(message.role),
        content=content,
        tool_calls=calls,
        tool_call_id=message.tool_call_id or "",
    )


def _role(role: str) -> str:
    # OpenAI's newer name for the system role; our chat templates know "system".
    return "system" if role == "developer" else role


def _content(content: str | list[TextContentPart] | None, index: int) -> str | tuple[TextPart, ...]:
    """A string stays one; text parts stay parts (the chat template sees what was sent)."""
    if content is None:
        raise InvalidRequestError(f"messages[{index}].content", "is required")
    if isinstance(content, str):
        return content
    return tuple(TextPart(part.text) for part in content)


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> list[tuple[str, tuple[int, ...]]]:
    """(text, token ids) per prompt: a string, a list of token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [(prompt, ())]
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    if all(isinstance(item, int) for item in prompt):
        return [("", tuple(int(item) for item in prompt))]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(
            "prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}"
        )
    return [
        (item, ()) if isinstance(item, str) else ("", tuple(item))  # type: ignore[arg-type]
        for item in prompt
    ]
