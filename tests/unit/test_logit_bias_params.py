"""logit_bias and allowed_token_ids from every door to SamplingParams: validation naming the
field, the vocabulary bound, the proto round trip, the OpenAI body and the offline JSONL."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from protos.llmserve.v1 import text_pb2
from services.common.sampling_proto import sampling_from_proto, sampling_to_proto
from services.contracts.errors import InvalidRequestError
from services.contracts.sampling_params import SamplingParams, logit_bias_from_json
from services.engine.offline import parse_sampling
from services.tokenizer.convert import sampling_input
from services.tokenizer.http.openai.errors import http_error
from services.tokenizer.http.openai.schemas import (
    chat_input,
    completion_inputs,
    parse_chat,
    parse_completion,
)
from services.tokenizer.validation import GenerateInput, Limits, SamplingInput, validate_sampling

VOCAB = 1000
LIMITS = Limits(model_name="tiny", max_model_len=64, vocab_size=VOCAB, max_new_tokens_limit=32)


def error_of(params: SamplingParams, vocab_size: int | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        params.validate(vocab_size=vocab_size)
    return raised.value


# ---- SamplingParams -------------------------------------------------------------------------


def test_logit_bias_is_stored_as_sorted_pairs_whatever_its_form() -> None:
    from_dict = SamplingParams(logit_bias={9: 1.0, 2: -3.0})  # type: ignore[arg-type]
    from_pairs = SamplingParams(logit_bias=((2, -3.0), (9, 1.0)))
    assert from_dict.logit_bias == ((2, -3.0), (9, 1.0))
    assert from_dict == from_pairs and hash(from_dict) == hash(from_pairs)
    allowed = SamplingParams(allowed_token_ids=(5, 1, 5, 3))
    assert allowed.allowed_token_ids == (1, 3, 5)
    assert SamplingParams().logit_bias == () and SamplingParams().allowed_token_ids is None


@pytest.mark.parametrize("bias", [-100.0, -100, 0.0, 42.5, 100.0, 100])
def test_biases_in_range_are_valid(bias: float) -> None:
    SamplingParams(logit_bias={7: bias}).validate(vocab_size=VOCAB)  # type: ignore[arg-type]


@pytest.mark.parametrize("bias", [100.5, -100.01, 1e9, math.inf, -math.inf, math.nan, True])
def test_biases_out_of_range_name_their_token(bias: float) -> None:
    error = error_of(SamplingParams(logit_bias={123: bias}))  # type: ignore[arg-type]
    assert error.field == "logit_bias[123]"


def test_at_most_300_biased_tokens() -> None:
    SamplingParams(logit_bias={i: 1.0 for i in range(300)}).validate()  # type: ignore[arg-type]
    error = error_of(SamplingParams(logit_bias={i: 1.0 for i in range(301)}))  # type: ignore[arg-type]
    assert error.field == "logit_bias"
    assert "300" in error.message and "301" in error.message


@pytest.mark.parametrize(
    ("bias", "field"),
    [
        (((1, 1.0), (1, 2.0)), "logit_bias[1]"),  # the same id twice
        (((-1, 1.0),), "logit_bias[-1]"),
        ((("7", 1.0),), "logit_bias"),
        (((1.5, 1.0),), "logit_bias"),
        (((1, "x"),), "logit_bias[1]"),
        (([1, 2.0],), "logit_bias"),
    ],
)
def test_ill_formed_logit_bias_names_the_field(bias: Any, field: str) -> None:
    assert error_of(SamplingParams(logit_bias=bias)).field == field


def test_ids_must_be_inside_the_vocabulary_when_it_is_known() -> None:
    SamplingParams(logit_bias={VOCAB + 5: 1.0}).validate()  # type: ignore[arg-type]
    error = error_of(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB)  # type: ignore[arg-type]
    assert error.field == f"logit_bias[{VOCAB}]"
    assert str(VOCAB) in error.message
    SamplingParams(logit_bias={VOCAB - 1: 1.0}).validate(vocab_size=VOCAB)  # type: ignore[arg-type]
    error = error_of(SamplingParams(allowed_token_ids=(1, VOCAB)), VOCAB)
    assert error.field == "allowed_token_ids"
    SamplingParams(allowed_token_ids=(0, VOCAB - 1)).validate(vocab_size=VOCAB)


@pytest.mark.parametrize(
    "allowed",
    [(), (-1,), (1, -3), ("4",), (True,), (1.0,)],
)
def test_bad_allowed_token_ids_are_refused(allowed: Any) -> None:
    assert error_of(SamplingParams(allowed_token_ids=allowed)).field == "allowed_token_ids"


def test_no_more_allowed_ids_than_the_vocabulary() -> None:
    error = error_of(SamplingParams(allowed_token_ids=tuple(range(11))), 10)
    assert error.field == "allowed_token_ids"


# ---- proto round trip and the gRPC door -----------------------------------------------------


def test_the_token_proto_carries_both_fields() -> None:
    params = SamplingParams(logit_bias={3: -100.0, 1: 2.5}, allowed_token_ids=(8, 4))  # type: ignore[arg-type]
    message = sampling_to_proto(params)
    assert dict(message.logit_bias) == {1: 2.5, 3: -100.0}
    assert list(message.allowed_token_ids) == [4, 8]
    assert sampling_from_proto(message) == params
    wire = type(message).FromString(message.SerializeToString())
    assert sampling_from_proto(wire) == params
    # Empty on the wire is "not given", never an empty allow-list that bans every token.
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).allowed_token_ids is None


def grpc_sampling(**fields: Any) -> SamplingParams:
    return validate_sampling(sampling_input(text_pb2.SamplingParams(**fields)), LIMITS)


def test_the_public_proto_reaches_sampling_params() -> None:
    params = grpc_sampling(logit_bias={5: 1.5, 2: -100}, allowed_token_ids=[9, 2])
    assert params.logit_bias == ((2, -100.0), (5, 1.5))
    assert params.allowed_token_ids == (2, 9)
    assert grpc_sampling().allowed_token_ids is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"logit_bias": {5: 100.5}}, "sampling.logit_bias[5]"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias"),
        ({"logit_bias": {VOCAB: 1.0}}, f"sampling.logit_bias[{VOCAB}]"),
        ({"logit_bias": {-4: 1.0}}, "sampling.logit_bias[-4]"),
        ({"allowed_token_ids": [1, VOCAB]}, "sampling.allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "sampling.allowed_token_ids"),
    ],
)
def test_the_tokenizer_tier_names_the_bad_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        grpc_sampling(**fields)
    assert raised.value.field == field


# ---- the OpenAI bodies ----------------------------------------------------------------------


def http_input(chat: bool, **fields: Any) -> GenerateInput:
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        return chat_input(parse_chat(json.dumps(body).encode()), "r", 32)
    body = {"model": "m", "prompt": "hi", **fields}
    (only,) = completion_inputs(parse_completion(json.dumps(body).encode()), "r")
    return only


def http_param(chat: bool, **fields: Any) -> str | None:
    """The 400's `param`, from the body's parse or from validation, as the door reports it."""
    try:
        validate_sampling(http_input(chat, **fields).sampling, LIMITS)
    except InvalidRequestError as exc:
        error = http_error(exc, chat)
        assert error.status == 400
        return error.param
    raise AssertionError("accepted")


@pytest.mark.parametrize("chat", [False, True])
def test_openai_logit_bias_and_vllm_allowed_token_ids(chat: bool) -> None:
    sampling = http_input(
        chat, logit_bias={"50": -100, "7": 3.5}, allowed_token_ids=[7, 50, 51]
    ).sampling
    assert sampling.logit_bias == ((50, -100.0), (7, 3.5))
    params = validate_sampling(sampling, LIMITS)
    assert params.logit_bias == ((7, 3.5), (50, -100.0))
    assert params.allowed_token_ids == (7, 50, 51)
    off = http_input(chat, logit_bias=None, allowed_token_ids=None).sampling
    assert off.logit_bias == () and off.allowed_token_ids is None
    assert http_input(chat, logit_bias={}).sampling.logit_bias == ()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {" 12": 1}}, "logit_bias"),
        ({"logit_bias": {"12": "x"}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"12": 100.5}}, "logit_bias[12]"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, f"logit_bias[{VOCAB}]"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
        ({"allowed_token_ids": ["a"]}, "allowed_token_ids[0]"),
    ],
)
def test_bad_openai_values_are_400_naming_the_parameter(
    chat: bool, fields: dict[str, Any], param: str
) -> None:
    assert http_param(chat, **fields) == param


# ---- offline JSONL --------------------------------------------------------------------------


def test_offline_lines_take_both_fields() -> None:
    params = parse_sampling({"logit_bias": {"3": 2, "1": -1.5}, "allowed_token_ids": [4, 3]})
    assert params.logit_bias == ((1, -1.5), (3, 2.0))
    assert params.allowed_token_ids == (3, 4)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"logit_bias": {"x": 1}}, "sampling.logit_bias"),
        ({"logit_bias": {"3": 101}}, "sampling.logit_bias[3]"),
        ({"logit_bias": {"3": False}}, "sampling.logit_bias[3]"),
        ({"allowed_token_ids": "1,2"}, "sampling.allowed_token_ids"),
        ({"allowed_token_ids": []}, "sampling.allowed_token_ids"),
    ],
)
def test_offline_lines_with_bad_values_name_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        parse_sampling(raw)
    assert raised.value.field == field


def test_logit_bias_from_json_null_is_none() -> None:
    assert logit_bias_from_json(None) == ()
    assert logit_bias_from_json({"0": 1}) == ((0, 1.0),)
    assert SamplingInput().logit_bias == ()


def test_every_key_that_is_not_a_token_id_is_named() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        logit_bias_from_json({"a": 1, "5": 1, "b": 2})
    assert caught.value.field == "logit_bias"
    assert "'a'" in caught.value.message and "'b'" in caught.value.message


def test_every_token_id_outside_the_vocabulary_is_named() -> None:
    params = SamplingParams(logit_bias={VOCAB: 1.0, 3: 1.0, VOCAB + 7: 2.0})  # type: ignore[arg-type]
    error = error_of(params, vocab_size=VOCAB)
    assert error.field == "logit_bias"
    assert str(VOCAB) in error.message and str(VOCAB + 7) in error.message
