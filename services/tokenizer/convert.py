"""Protobuf <-> plain data for the public text.proto messages (and lora.proto as the public API
reports adapters). The scheduler-facing half is routing/scheduler_convert.py."""

from __future__ import annotations

import json
from collections.abc import Iterable

from protos.llmserve.v1 import logprobs_pb2, lora_pb2, text_pb2
from services.common.named_prompt import NamedPrompt
from services.common.public_sampling_fields import OPTIONAL_SAMPLING_FIELDS
from services.common.sampling_proto import structured_output_from_proto
from services.contracts.errors import InvalidRequestError
from services.text.chat_template import ChatMessage, MessageToolCall
from services.tokenizer.output import OutputDelta
from services.tokenizer.routing.adapter_info import AdapterInfo
from services.tokenizer.routing.scheduler_snapshot import SchedulerSnapshot
from services.tokenizer.tool_request import FunctionTool, ToolChoiceMode, ToolRequest
from services.tokenizer.validation import GenerateInput, SamplingInput


def chat_messages(messages: Iterable[text_pb2.ChatMessage]) -> tuple[ChatMessage, ...]:
    return tuple(
        ChatMessage(
            role=m.role,
            content=m.content,
            tool_calls=tuple(MessageToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            tool_call_id=m.tool_call_id,
        )
        for m in messages
    )


_TOOL_CHOICES = {
    text_pb2.ToolChoice.AUTO: ToolChoiceMode.AUTO,
    text_pb2.ToolChoice.NONE: ToolChoiceMode.NONE,
    text_pb2.ToolChoice.REQUIRED: ToolChoiceMode.REQUIRED,
    text_pb2.ToolChoice.FUNCTION: ToolChoiceMode.FUNCTION,
}


def tool_request(request: text_pb2.GenerateRequest) -> ToolRequest | None:
    """The request's tools (None without any); a schema that is not a JSON object is refused
    naming its field."""
    if not request.tools:
        if request.tool_choice.mode in (text_pb2.ToolChoice.REQUIRED, text_pb2.ToolChoice.FUNCTION):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    tools = []
    for index, tool in enumerate(request.tools):
        parameters: object = {}
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"tools[{index}].parameters", f"is not valid JSON: {exc}"
                ) from None
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{index}].parameters", "must be a JSON object")
        tools.append(FunctionTool(tool.name, tool.description, parameters, tool.strict))
    mode = _TOOL_CHOICES.get(request.tool_choice.mode)
    if mode is None:
        raise InvalidRequestError("tool_choice.mode", f"unknown mode {request.tool_choice.mode}")
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    return ToolRequest(tuple(tools), mode, request.tool_choice.function_name, parallel)


def sampling_input(sampling: text_pb2.SamplingParams) -> SamplingInput:
    """proto3 `optional` fields: unset stays None, so SamplingParams' defaults apply."""
    given = {
        name: getattr(sampling, name)
        for name in OPTIONAL_SAMPLING_FIELDS
        if sampling.HasField(name)
    }
    return SamplingInput(
        **given,
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
        logit_bias=tuple(sampling.logit_bias.items()),
        # proto3: an empty list is an absent one, no restriction.
        allowed_token_ids=tuple(sampling.allowed_token_ids) or None,
        structured_output=structured_output_from_proto(sampling.structured_output),
    )


def generate_input(request: text_pb2.GenerateRequest) -> GenerateInput:
    return GenerateInput(
        request_id=request.request_id,
        prompt=request.prompt,
        messages=chat_messages(request.messages),
        prompt_token_ids=tuple(request.prompt_token_ids),
        tool_request=tool_request(request),
        deadline_ms=request.deadline_ms,
        model=request.model,
        prompt_name=request.prompt_name,
        tenant_id=request.tenant_id,
        sampling=sampling_input(request.sampling),
    )


def generate_response(request_id: str, delta: OutputDelta) -> text_pb2.GenerateResponse:
    """A public message; usage and timings only on the last one of a stream."""
    response = text_pb2.GenerateResponse(
        request_id=request_id,
        text=delta.text,
        token_ids=list(delta.token_ids),
        logprobs=[
            logprobs_pb2.TokenLogprob(
                token_id=item.token_id,
                logprob=item.logprob,
                top_token_ids=list(item.top_token_ids),
                top_logprobs=list(item.top_logprobs),
            )
            for item in delta.logprobs
        ],
        finish_reason=delta.finish_reason,
        index=delta.index,
        reasoning_text=delta.reasoning_text,
        tool_calls=[
            text_pb2.ToolCallDelta(
                index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments
            )
            for piece in delta.tool_calls
        ],
        matched_stop=delta.matched_stop,
    )
    if delta.usage is not None:
        response.usage.CopyFrom(
            text_pb2.Usage(
                prompt_tokens=delta.usage.prompt_tokens,
                completion_tokens=delta.usage.completion_tokens,
                cached_prompt_tokens=delta.usage.cached_prompt_tokens,
            )
        )
    if delta.timings is not None:
        response.timings.CopyFrom(
            text_pb2.Timings(
                queue_ms=delta.timings.queue_ms,
                ttft_ms=delta.timings.ttft_ms,
                total_ms=delta.timings.total_ms,
            )
        )
    return response


def model_info(
    name: str,
    max_model_len: int,
    vocab_size: int,
    stats: SchedulerSnapshot | None,
    parent: str = "",
) -> text_pb2.ModelInfo:
    """The served model, or (with its `parent`, the served model's name) a LoRA adapter of it;
    dtype, KV cache dtype and quantization are the workers', as a scheduler's stats report
    them (empty while no scheduler has answered)."""
    info = text_pb2.ModelInfo(
        name=name, max_model_len=max_model_len, vocab_size=vocab_size, parent=parent
    )
    if stats is not None:
        info.dtype = stats.dtype
        info.kv_cache_dtype = stats.kv_cache_dtype
        info.quantization = stats.quantization
    return info


def registered_prompt(
    prompt: NamedPrompt, num_pinned_schedulers: int = 0
) -> text_pb2.RegisteredPrompt:
    return text_pb2.RegisteredPrompt(
        name=prompt.name,
        num_tokens=len(prompt.token_ids),
        expires_unix_s=prompt.expires_unix_s,
        num_pinned_schedulers=num_pinned_schedulers,
        tenant_id=prompt.tenant_id,
    )


def lora_adapter_info(info: AdapterInfo) -> lora_pb2.LoraAdapterInfo:
    """An adapter as the public API reports it, over the pool: slot -1, since each worker
    places it in a slot of its own (or none)."""
    return lora_pb2.LoraAdapterInfo(
        name=info.name,
        path=info.path,
        rank=info.rank,
        targets=list(info.targets),
        scaling=info.scaling,
        load_ms=info.load_ms,
        slot=-1,
        num_running=info.num_running,
        parent=info.parent,
        num_loaded_schedulers=info.num_loaded_schedulers,
    )
