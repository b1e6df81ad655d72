"""SamplingParams ↔ the token-level sampling proto shared by the engine and worker contracts."""

from __future__ import annotations

from protos.llmserve.v1 import sampling_pb2
from services.contracts.sampling_params import SamplingParams
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.TokenSamplingParams:
    message = sampling_pb2.TokenSamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=list(params.allowed_token_ids or ()),
        n=params.n,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.num_speculative_tokens is not None:
        message.num_speculative_tokens = params.num_speculative_tokens
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    return message


def sampling_from_proto(message: sampling_pb2.TokenSamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.HasField("seed") else None,
        max_new_tokens=message.max_new_tokens,
        min_new_tokens=message.min_new_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs,
        logit_bias=tuple(message.logit_bias.items()),
        # proto3 cannot tell an empty list from an absent one: empty means no restriction.
        allowed_token_ids=tuple(message.allowed_token_ids) or None,
        # 0 from a sender that predates the field: one choice.
        n=message.n or 1,
        structured_output=structured_output_from_proto(message.structured_output),
        num_speculative_tokens=(
            message.num_speculative_tokens if message.HasField("num_speculative_tokens") else None
        ),
    )


def structured_output_to_proto(spec: StructuredOutput) -> sampling_pb2.StructuredOutput:
    starts_after = list(spec.starts_after)
    if spec.kind is StructuredOutputKind.JSON_OBJECT:
        return sampling_pb2.StructuredOutput(json_object=True, starts_after=starts_after)
    return sampling_pb2.StructuredOutput(**{spec.kind.value: spec.text}, starts_after=starts_after)


def structured_output_from_proto(
    message: sampling_pb2.StructuredOutput,
) -> StructuredOutput | None:
    """None when no kind is set (and for json_object: false, which asks for nothing)."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    starts_after = tuple(message.starts_after)
    if kind == "json_object":
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT, starts_after=starts_after)
    return StructuredOutput(StructuredOutputKind(kind), getattr(message, kind), starts_after)
