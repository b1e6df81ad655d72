"""Validation at the edge: a public Generate request (as plain data) → prompt token ids,
SamplingParams and stop strings, or InvalidRequestError naming the field as text.proto spells
it ("prompt", "messages[2].role", "sampling.top_p"). Pure: no gRPC, no clock, no I/O."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from services.common.cache_keys import PROMPT_NAME_PATTERN
from services.common.named_prompt import NamedPrompt
from services.common.prefix_hash import tenant_salt
from services.common.prompt_checks import check_prompt_length, check_token_ids
from services.contracts.errors import InvalidRequestError, NotFoundError, PromptTooLongError, quoted
from services.contracts.sampling_params import SamplingParams
from services.contracts.structured_output import StructuredOutput
from services.text.chat_template import ChatMessage
from services.tokenizer.tool_request import ToolRequest, check_tool_request, forced_call_grammar

# Identifiers are echoed into log lines and keys; bounded at the edge, both doors. A UUID is 36
# characters, a W3C trace id 55, a Hugging Face model id rarely over 100.
MAX_REQUEST_ID_LEN = 128
MAX_TENANT_ID_LEN = 128
MAX_MODEL_NAME_LEN = 256
MAX_PROMPT_NAME_LEN = 128  # as PROMPT_NAME_PATTERN says

_DEFAULT_MAX_NEW_TOKENS = SamplingParams().max_new_tokens


class PromptTokenizer(Protocol):
    """What validation needs from ModelTokenizer."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]: ...

    def encode_chat_after_prefix(
        self,
        prefix_messages: Sequence[ChatMessage],
        prefix_ids: Sequence[int],
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class SamplingInput:
    """The public sampling fields as sent; None = unset (SamplingParams' default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    n: int | None = None
    structured_output: StructuredOutput | None = None
    num_speculative_tokens: int | None = None
    structured_output_param: str = ""
    """The parameter that carried structured_output, as the door spells it (HTTP:
    "response_format", "guided_regex", ...), for errors; empty: the gRPC field."""


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A public GenerateRequest as plain data (proto3: empty string/list = not given)."""

    request_id: str = ""
    prompt: str = ""
    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingInput = field(default_factory=SamplingInput)
    deadline_ms: int = 0
    model: str = ""
    prompt_name: str = ""
    tenant_id: str = ""
    tenant_weight: int = 1
    """The calling key's weight in the schedulers' fair shares (never from the request)."""
    tool_request: ToolRequest | None = None
    """The functions the model may call and how (chat only): their schemas reach the chat
    template, a forced choice becomes the request's grammar."""
    continue_final_message: bool = False
    """The answer continues the last message (an assistant prefill) instead of opening a
    new turn (chat only)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model and the tier's config allow."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_new_tokens_limit: int
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_prompt_chars: int | None = None
    """Most characters of prompt text that can fit the context (ServedModel derives it from
    the tokenizer): longer text is refused without tokenizing it. None = no such bound."""


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """Everything the Generate flow needs, already checked."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]
    deadline_s: float | None
    """The request's own time budget (deadline_ms); None = only the gRPC deadline applies."""
    cache_salt: bytes = b""
    """The tenant's prefix-cache salt (empty: the shared cache)."""
    structured_output_param: str = ""
    """The public name of the parameter holding sampling.structured_output, for the errors
    of its compile (which runs after this validation, off the event loop)."""
    is_chat: bool = False
    """The prompt was chat messages (a reasoning parser applies to chat answers only)."""
    tool_request: ToolRequest | None = None
    """The functions the answer may call (its output is read for calls)."""
    tenant_id: str = ""
    tenant_weight: int = 1
    lora_name: str = ""
    """The LoRA adapter the request's `model` names; empty: the base model."""


def validate_generate(
    request: GenerateInput,
    limits: Limits,
    tokenizer: PromptTokenizer,
    named_prompt: NamedPrompt | None = None,
    lora_adapters: Collection[str] = (),
) -> ValidatedRequest:
    """Raise InvalidRequestError naming the first bad field, else return the validated request.
    `lora_adapters`: the adapter names `model` may name besides the served model.

    Cheap checks first, tokenization last, so a bad sampling field costs no tokenizer work.
    """
    request_id = validate_request_id(request.request_id)
    lora_name = validate_model(request.model, limits.model_name, lora_adapters)
    validate_tenant_id(request.tenant_id)
    if request.prompt_name:
        validate_prompt_name(request.prompt_name, "prompt_name")
    sampling = validate_sampling(request.sampling, limits)
    stop = validate_stop_strings(request.sampling.stop, limits)
    sampling, spec_param = _with_forced_call(request, sampling)
    prompt_token_ids = prompt_to_token_ids(request, limits, tokenizer, named_prompt)
    deadline_s = request.deadline_ms / 1000.0 if request.deadline_ms > 0 else None
    return ValidatedRequest(
        request_id,
        prompt_token_ids,
        sampling,
        stop,
        deadline_s,
        tenant_salt(request.tenant_id),
        spec_param,
        is_chat=bool(request.messages),
        tool_request=request.tool_request,
        tenant_id=request.tenant_id,
        tenant_weight=request.tenant_weight,
        lora_name=lora_name,
    )


def _with_forced_call(
    request: GenerateInput, sampling: SamplingParams
) -> tuple[SamplingParams, str]:
    """The sampling parameters with a forced call's grammar, and the parameter that carried
    the request's grammar (for its compile's errors)."""
    tools = request.tool_request
    param = structured_output_param(request.sampling)
    if tools is None:
        return sampling, param
    if not request.messages:
        raise InvalidRequestError("tools", "apply to chat requests: send messages")
    check_tool_request(tools, "tools", "tool_choice")
    grammar = forced_call_grammar(tools)
    if grammar is None:
        return sampling, param
    if sampling.structured_output is not None:
        raise InvalidRequestError(
            "tool_choice", f"forces a call, whose grammar {param} would replace: send one"
        )
    return replace(sampling, structured_output=grammar), "tools"


def structured_output_param(sampling: SamplingInput) -> str:
    """Where a structured-output error points: the door's parameter, else the gRPC field."""
    if sampling.structured_output is None:
        return ""
    return sampling.structured_output_param or f"sampling.{sampling.structured_output.field}"


def validate_request_id(request_id: str) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise InvalidRequestError(
            "request_id", f"must be at most {MAX_REQUEST_ID_LEN} printable characters"
        )
    return request_id


def validate_model(model: str, served: str, lora_adapters: Collection[str] = ()) -> str:
    """The LoRA adapter a request's `model` names: empty for the served model (an empty model
    means it too), the name itself for one of `lora_adapters`; NotFoundError for any other."""
    if not model or model == served:
        return ""
    if len(model) > MAX_MODEL_NAME_LEN:
        raise InvalidRequestError("model", f"must be at most {MAX_MODEL_NAME_LEN} characters")
    if model in lora_adapters:
        return model
    adapters = f", and {len(lora_adapters)} LoRA adapters ListModels lists" if lora_adapters else ""
    raise NotFoundError("model", f"unknown model {quoted(model)} (served: {served!r}{adapters})")


def validate_tenant_id(tenant_id: str, field_name: str = "tenant_id") -> None:
    if len(tenant_id) > MAX_TENANT_ID_LEN or not tenant_id.isprintable():
        raise InvalidRequestError(
            field_name, f"must be at most {MAX_TENANT_ID_LEN} printable characters"
        )


def validate_prompt_name(name: str, field_name: str = "name") -> None:
    """A name RegisterPrompt would accept; any other can name no prompt, and is refused before
    it is looked up."""
    if not PROMPT_NAME_PATTERN.match(name):
        raise InvalidRequestError(
            field_name, f"must be 1-{MAX_PROMPT_NAME_LEN} characters of A-Z a-z 0-9 _ . -"
        )


def validate_sampling(sampling: SamplingInput, limits: Limits) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; errors name "sampling.<field>"."""
    given = {
        f.name: getattr(sampling, f.name)
        for f in fields(SamplingParams)
        if f.name != "stop_token_ids" and getattr(sampling, f.name, None) is not None
    }
    if sampling.max_new_tokens is None:
        # The default (256) must not make a request invalid on a short-context deployment.
        given["max_new_tokens"] = min(_DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens_limit)
    params = SamplingParams(**given, stop_token_ids=tuple(sampling.stop_token_ids))
    try:
        params.validate(
            max_new_tokens_limit=limits.max_new_tokens_limit, vocab_size=limits.vocab_size
        )
    except InvalidRequestError as exc:
        if exc.field.startswith("structured_output") and sampling.structured_output_param:
            raise InvalidRequestError(sampling.structured_output_param, exc.message) from exc
        raise InvalidRequestError(f"sampling.{exc.field}", exc.message) from exc
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "sampling.stop_token_ids",
            f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
        )
    return params


def validate_stop_strings(stop: Sequence[str], limits: Limits) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            "sampling.stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}"
        )
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequestError("sampling.stop", f"stop string {index} is empty")
        if len(text) > limits.max_stop_string_len:
            raise InvalidRequestError(
                "sampling.stop",
                f"stop string {index} has {len(text)} characters, "
                f"over the limit of {limits.max_stop_string_len}",
            )
    # Duplicates change nothing in matching; drop them, keep the order.
    return tuple(dict.fromkeys(stop))


def prompt_to_token_ids(
    request: GenerateInput,
    limits: Limits,
    tokenizer: PromptTokenizer,
    named_prompt: NamedPrompt | None = None,
) -> tuple[int, ...]:
    """Exactly one of prompt, messages, prompt_token_ids → ids that fit the context."""
    given = [
        name
        for name, value in (
            ("prompt", request.prompt),
            ("messages", request.messages),
            ("prompt_token_ids", request.prompt_token_ids),
        )
        if value
    ]
    if not given:
        raise InvalidRequestError(
            "prompt", "is empty: set one of prompt, messages or prompt_token_ids"
        )
    if len(given) > 1:
        raise InvalidRequestError(
            "prompt", f"set exactly one of prompt, messages, prompt_token_ids; got {given}"
        )
    check_prompt_size(request, limits)
    if named_prompt is not None:
        token_ids = _ids_after_named_prompt(request, tokenizer, named_prompt)
    elif request.prompt_token_ids:
        token_ids = tuple(int(t) for t in request.prompt_token_ids)
        check_token_ids("prompt_token_ids", token_ids, limits.vocab_size)
    elif request.messages:
        token_ids = tuple(
            tokenizer.apply_chat_template(
                request.messages,
                tools=_template_tools(request),
                continue_final_message=request.continue_final_message,
            )
        )
    else:
        token_ids = tuple(tokenizer.encode(request.prompt))
    check_prompt_length(len(token_ids), limits.max_model_len)
    return token_ids


def check_prompt_size(request: GenerateInput, limits: Limits) -> None:
    """Refuse, before any tokenizer work, a prompt too large for the context whatever its
    tokens: more ids than the context holds, more text than max_prompt_chars (a chat's
    messages, their calls and its tools together), more chat messages than the context has
    tokens (every chat template marks where a message starts)."""
    if len(request.prompt_token_ids) >= limits.max_model_len:
        check_prompt_length(len(request.prompt_token_ids), limits.max_model_len)
    if len(request.messages) >= limits.max_model_len:
        raise PromptTooLongError(
            "messages",
            f"has {len(request.messages)} messages; the context holds {limits.max_model_len} "
            "tokens",
        )
    if request.tool_request is not None:
        check_text_size("tools", _tools_chars(request.tool_request), limits)
    if request.messages:
        check_text_size("messages", chat_chars(request.messages, request.tool_request), limits)
    else:
        check_text_size("prompt", len(request.prompt), limits)


def check_text_size(field_name: str, num_chars: int, limits: Limits) -> None:
    """Refuse text too long for any context (max_prompt_chars) before it is tokenized."""
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise PromptTooLongError(
            field_name,
            f"has {num_chars} characters; a context of {limits.max_model_len} tokens holds at "
            f"most {limits.max_prompt_chars}",
        )


def chat_chars(messages: Sequence[ChatMessage], tools: ToolRequest | None = None) -> int:
    """The text a chat template renders: the messages', their calls' and the tools'."""
    num_chars = sum(
        len(m.text) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls) for m in messages
    )
    return num_chars + (_tools_chars(tools) if tools is not None else 0)


def _tools_chars(tools: ToolRequest) -> int:
    # The schema's JSON text stands for its rendering (templates print it as JSON).
    return sum(
        len(t.name) + len(t.description) + len(json.dumps(t.parameters)) for t in tools.tools
    )


def _ids_after_named_prompt(
    request: GenerateInput, tokenizer: PromptTokenizer, named_prompt: NamedPrompt
) -> tuple[int, ...]:
    """A named prompt is the system message of a chat request."""
    if not request.messages:
        raise InvalidRequestError("prompt_name", "applies to chat requests: send messages")
    if any(message.role == "system" for message in request.messages):
        raise InvalidRequestError(
            "messages", "must not contain a system message when prompt_name is set"
        )
    system = (ChatMessage(role="system", content=named_prompt.system_prompt),)
    return tuple(
        tokenizer.encode_chat_after_prefix(
            system, named_prompt.token_ids, request.messages, tools=_template_tools(request)
        )
    )


def _template_tools(request: GenerateInput) -> tuple[Mapping[str, Any], ...] | None:
    """The tools as the chat template takes them (None: the request has none)."""
    if request.tool_request is None or not request.tool_request.tools:
        return None
    return request.tool_request.template_tools()
