"""OpenAI request bodies → GenerateInput; every parameter we cannot honour refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.contracts.errors import InvalidRequestError
from services.text.chat_template import ChatMessage, TextPart
from services.tokenizer.http.openai.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    chat_input,
    completion_inputs,
    parse_chat,
    parse_completion,
    structured_output,
)
from services.tokenizer.validation import GenerateInput

LIMIT = 777
"""The tier's max_new_tokens_limit in these tests (an odd number no default could equal)."""


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon", **fields}


def encode(body: object) -> bytes:
    return json.dumps(body).encode()


def chat(**fields: Any) -> GenerateInput:
    return chat_input(parse_chat(encode(chat_body(**fields))), "req-1", LIMIT)


def completion(**fields: Any) -> GenerateInput:
    (only,) = completion_inputs(parse_completion(encode(completion_body(**fields))), "req-2")
    return only


def chat_error(body: object) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        chat_input(parse_chat(body if isinstance(body, bytes) else encode(body)), "r", LIMIT)
    return raised.value


def completion_error(body: object) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        completion_inputs(parse_completion(body if isinstance(body, bytes) else encode(body)), "r")
    return raised.value


# ---- chat → GenerateInput -------------------------------------------------------------------


def test_chat_messages_become_the_conversation() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert request.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello."),
        ChatMessage("user", "Bye"),
    )
    assert request.request_id == "req-1"
    assert request.model == "tiny"
    assert request.prompt == "" and request.prompt_token_ids == ()


def test_the_developer_role_is_the_system_role() -> None:
    request = chat(
        messages=[{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}]
    )
    assert request.messages[0] == ChatMessage("system", "Rules.")


def test_content_as_a_list_of_text_parts_stays_parts() -> None:
    request = chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
            }
        ]
    )
    parts = (TextPart("Hello, "), TextPart("world"))
    assert request.messages == (ChatMessage("user", parts),)
    assert request.messages[0].text == "Hello, world"


def test_null_content_is_refused_naming_the_message() -> None:
    error = chat_error(
        chat_body(messages=[{"role": "user", "content": "a"}, {"role": "assistant"}])
    )
    assert error.field == "messages[1].content"


@pytest.mark.parametrize(
    ("stop", "expected"), [("END", ("END",)), (["a", "bb"], ("a", "bb")), (None, ())]
)
def test_stop_as_a_string_or_a_list(stop: object, expected: tuple[str, ...]) -> None:
    assert chat(stop=stop).sampling.stop == expected
    assert completion(stop=stop).sampling.stop == expected


def test_chat_max_tokens() -> None:
    assert chat().sampling.max_new_tokens == LIMIT  # unset: as long as the context allows
    assert chat(max_tokens=5).sampling.max_new_tokens == 5
    assert chat(max_completion_tokens=7).sampling.max_new_tokens == 7
    # The newer name wins over the deprecated one.
    assert chat(max_tokens=5, max_completion_tokens=7).sampling.max_new_tokens == 7


def test_completion_max_tokens() -> None:
    assert completion().sampling.max_new_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert completion(max_tokens=40).sampling.max_new_tokens == 40


def test_max_completion_tokens_is_a_chat_parameter_only() -> None:
    assert completion_error(completion_body(max_completion_tokens=5)).field == (
        "max_completion_tokens"
    )


@pytest.mark.parametrize(
    ("fields", "engine_logprobs"),
    [
        ({}, 0),
        ({"logprobs": False}, 0),
        ({"logprobs": None}, 0),
        ({"logprobs": False, "top_logprobs": 0}, 0),
        # The engine reports the chosen token with at least one alternative.
        ({"logprobs": True}, 1),
        ({"logprobs": True, "top_logprobs": None}, 1),
        ({"logprobs": True, "top_logprobs": 0}, 1),
        ({"logprobs": True, "top_logprobs": 3}, 3),
        ({"logprobs": True, "top_logprobs": 20}, 20),
    ],
)
def test_chat_logprobs(fields: dict[str, Any], engine_logprobs: int) -> None:
    assert chat(**fields).sampling.logprobs == engine_logprobs


@pytest.mark.parametrize(("logprobs", "engine_logprobs"), [(None, 0), (0, 1), (1, 1), (5, 5)])
def test_completion_logprobs(logprobs: int | None, engine_logprobs: int) -> None:
    assert completion(logprobs=logprobs).sampling.logprobs == engine_logprobs


@pytest.mark.parametrize("top_logprobs", [-1, 21])
def test_top_logprobs_out_of_range_is_refused(top_logprobs: int) -> None:
    assert chat_error(chat_body(logprobs=True, top_logprobs=top_logprobs)).field == "top_logprobs"


def test_top_logprobs_without_logprobs_is_refused() -> None:
    error = chat_error(chat_body(top_logprobs=2))
    assert error.field == "top_logprobs"
    assert "logprobs" in error.message
    assert chat_error(chat_body(logprobs=False, top_logprobs=2)).field == "top_logprobs"


def test_sampling_parameters_pass_through() -> None:
    sampling = chat(
        temperature=0.7,
        top_p=0.9,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
    ).sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, 0.9, 42)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.25)


@pytest.mark.parametrize("n", [None, 1, 2, 16, 0, 17])
def test_n_passes_through_to_be_checked_with_the_sampling_fields(n: int | None) -> None:
    """n = 0 or 17 is refused where every sampling field is checked (validation.py)."""
    assert chat(n=n).sampling.n == n
    assert completion(n=n).sampling.n == n


def test_unset_sampling_parameters_stay_unset() -> None:
    # None lets SamplingParams' defaults apply (temperature 1, top_p 1...).
    sampling = completion().sampling
    assert sampling.temperature is None and sampling.top_p is None and sampling.seed is None
    assert sampling.top_k is None and sampling.min_new_tokens is None
    assert sampling.ignore_eos is False and sampling.stop_token_ids == ()


@pytest.mark.parametrize("make", [chat, completion])
def test_vllm_extensions(make: Any) -> None:
    sampling = make(
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=3,
        stop_token_ids=[2, 7],
    ).sampling
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (40, 0.05, 1.1)
    assert sampling.ignore_eos is True
    assert sampling.min_new_tokens == 3
    assert sampling.stop_token_ids == (2, 7)


def test_our_extensions() -> None:
    request = chat(deadline_ms=1500, tenant_id="acme", prompt_name="support-bot")
    assert (request.deadline_ms, request.tenant_id, request.prompt_name) == (
        1500,
        "acme",
        "support-bot",
    )
    request = completion(deadline_ms=250, tenant_id="globex")
    assert (request.deadline_ms, request.tenant_id) == (250, "globex")
    unset = chat()
    assert (unset.deadline_ms, unset.tenant_id, unset.prompt_name) == (0, "", "")


def test_prompt_name_is_a_chat_parameter_only() -> None:
    assert completion_error(completion_body(prompt_name="bot")).field == "prompt_name"


def test_a_negative_deadline_is_refused() -> None:
    assert chat_error(chat_body(deadline_ms=-1)).field == "deadline_ms"


# ---- completions: the prompt's forms --------------------------------------------------------


def test_prompt_as_text() -> None:
    request = completion(prompt="Once upon a time")
    assert (request.prompt, request.prompt_token_ids) == ("Once upon a time", ())
    assert request.messages == ()
    assert request.request_id == "req-2"


def test_prompt_as_token_ids() -> None:
    request = completion(prompt=[101, 7, 0, 65535])
    assert (request.prompt, request.prompt_token_ids) == ("", (101, 7, 0, 65535))


@pytest.mark.parametrize(
    ("prompt", "text", "token_ids"),
    [(["Once upon"], "Once upon", ()), ([[5, 6, 7]], "", (5, 6, 7))],
)
def test_a_batch_of_one_prompt_is_unwrapped(
    prompt: object, text: str, token_ids: tuple[int, ...]
) -> None:
    request = completion(prompt=prompt)
    assert (request.prompt, request.prompt_token_ids) == (text, token_ids)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (["a", "b", "c"], [("a", ()), ("b", ()), ("c", ())]),
        ([[1, 2], [3]], [("", (1, 2)), ("", (3,))]),
    ],
)
def test_a_batch_is_one_input_per_prompt_with_its_own_request_id(
    prompt: object, expected: list[tuple[str, tuple[int, ...]]]
) -> None:
    body = parse_completion(encode(completion_body(prompt=prompt, n=2, max_tokens=5)))
    inputs = completion_inputs(body, "req")
    assert [(i.prompt, i.prompt_token_ids) for i in inputs] == expected
    assert [i.request_id for i in inputs] == [f"req-{n}" for n in range(len(expected))]
    assert {(i.sampling.n, i.sampling.max_new_tokens) for i in inputs} == {(2, 5)}


def test_more_prompts_than_the_limit_is_refused_naming_prompt() -> None:
    error = completion_error(completion_body(prompt=["x"] * (MAX_PROMPTS + 1)))
    assert error.field == "prompt"
    assert str(MAX_PROMPTS) in error.message


def test_an_empty_prompt_list_is_refused() -> None:
    assert completion_error(completion_body(prompt=[])).field == "prompt"


@pytest.mark.parametrize("prompt", [5, True, None, {"text": "x"}, [1, "a"]])
def test_a_prompt_of_the_wrong_type_is_refused(prompt: object) -> None:
    assert completion_error(completion_body(prompt=prompt)).field.startswith("prompt")


# ---- refused: unknown and unimplemented parameters ------------------------------------------


@pytest.mark.parametrize("name", ["frobnicate", "functions", "logprob", "max_new_tokens"])
def test_an_unknown_parameter_is_refused_by_name(name: str) -> None:
    for error in (
        chat_error(chat_body(**{name: 1})),
        completion_error(completion_body(**{name: 1})),
    ):
        assert error.field == name
        assert name in error.message


def test_an_unknown_nested_parameter_names_its_path() -> None:
    error = chat_error(chat_body(stream=True, stream_options={"include_usage": True, "x": 1}))
    assert error.field == "stream_options.x"
    error = chat_error(chat_body(messages=[{"role": "user", "content": "x", "audio": {}}]))
    assert error.field == "messages[0].audio"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", " the end"),
        ("best_of", 2),
    ],
)
def test_completion_parameters_we_do_not_implement_are_refused(field: str, value: object) -> None:
    assert completion_error(completion_body(**{field: value})).field == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 1),
        ("n", None),
        ("logit_bias", {}),
        ("logit_bias", None),
        ("tools", None),
        ("tools", []),
        ("tool_choice", "none"),
        ("tool_choice", None),
        ("parallel_tool_calls", None),
        ("response_format", {"type": "text"}),
        ("response_format", None),
        ("logprobs", None),
        ("top_logprobs", None),
        ("stream", None),
        ("stream_options", None),
        ("user", None),
        ("seed", None),
        ("stop", None),
        ("temperature", None),
    ],
)
def test_chat_parameters_at_their_off_value_are_accepted(field: str, value: object) -> None:
    chat(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 1),
        ("n", None),
        ("logit_bias", {}),
        ("logit_bias", None),
        ("echo", False),
        ("echo", None),
        ("suffix", None),
        ("suffix", ""),
        ("best_of", 1),
        ("best_of", None),
        ("logprobs", None),
        ("stream", None),
        ("ignore_eos", None),
    ],
)
def test_completion_parameters_at_their_off_value_are_accepted(field: str, value: object) -> None:
    completion(**{field: value})


def test_a_null_flag_is_false() -> None:
    assert completion(ignore_eos=None).sampling.ignore_eos is False
    body = parse_chat(encode(chat_body(stream=None, logprobs=None)))
    assert body.stream is False and body.logprobs is False


def test_one_endpoints_parameters_are_unknown_at_the_other() -> None:
    assert completion_error(completion_body(tools=[])).field == "tools"
    assert chat_error(chat_body(echo=False)).field == "echo"


# ---- refused: malformed bodies --------------------------------------------------------------


@pytest.mark.parametrize("body", [b"{", b"", b"{'model': 'tiny'}", b'{"model": "tiny",}'])
def test_invalid_json_is_refused_with_no_field(body: bytes) -> None:
    for error in (chat_error(body), completion_error(body)):
        assert error.field == ""
        assert "not valid JSON" in error.message


@pytest.mark.parametrize("body", [b"[]", b"3", b'"hello"', b"null", b"true"])
def test_a_body_that_is_not_an_object_is_refused_with_no_field(body: bytes) -> None:
    for error in (chat_error(body), completion_error(body)):
        assert error.field == ""
        assert "JSON object" in error.message


def test_a_missing_model_is_named() -> None:
    body = chat_body()
    del body["model"]
    error = chat_error(body)
    assert error.field == "model" and "required" in error.message
    body = completion_body()
    del body["model"]
    assert completion_error(body).field == "model"


def test_missing_messages_and_prompt_are_named() -> None:
    assert chat_error({"model": "tiny"}).field == "messages"
    assert completion_error({"model": "tiny"}).field == "prompt"


def test_an_empty_conversation_is_refused() -> None:
    assert chat_error(chat_body(messages=[])).field == "messages"


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "messages[1].role"),
        ([{"content": "a"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"text": "a"}}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text"}]}],
            "messages[1].content[0].text",
        ),
        ([{"role": "user", "content": "a", "name": "bob"}], "messages[0].name"),
        (["hello"], "messages[0]"),
        ("hello", "messages"),
    ],
)
def test_a_wrong_type_names_its_nested_path(messages: object, field: str) -> None:
    assert chat_error(chat_body(messages=messages)).field == field


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("max_tokens", "many", "max_tokens"),
        ("max_tokens", 0, "max_tokens"),
        ("max_completion_tokens", 0, "max_completion_tokens"),
        ("temperature", 2.5, "temperature"),
        ("temperature", -0.1, "temperature"),
        ("top_p", 0, "top_p"),
        ("presence_penalty", 3, "presence_penalty"),
        ("stop", 5, "stop"),
        ("stop", ["a", 5], "stop[1]"),
        ("stop_token_ids", ["eos"], "stop_token_ids[0]"),
        ("min_tokens", -1, "min_tokens"),
        ("stream_options", {"include_usage": "sometimes"}, "stream_options.include_usage"),
        ("logprobs", "yes please", "logprobs"),
    ],
)
def test_a_bad_value_names_the_parameter(field: str, value: object, named: str) -> None:
    error = chat_error(chat_body(**{field: value}))
    assert error.field == named
    assert error.message  # says what is wrong


def test_a_range_error_says_the_bound() -> None:
    error = chat_error(chat_body(temperature=9))
    assert error.field == "temperature"
    assert "2" in error.message


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": ["hello"]}, "messages[0]"),
        ({"stream_options": True}, "stream_options"),
    ],
)
def test_a_nested_non_object_is_not_called_the_body(fields: dict[str, Any], named: str) -> None:
    error = chat_error(chat_body(**fields))
    assert error.field == named
    assert "body" not in error.message


@pytest.mark.parametrize(
    ("field", "limit"),
    [("model", 256), ("tenant_id", 128), ("user", 256), ("prompt_name", 128)],
)
def test_identifiers_are_bounded(field: str, limit: int) -> None:
    assert getattr(chat(**{field: "a" * limit}), field, "a" * limit) == "a" * limit
    error = chat_error(chat_body(**{field: "a" * (limit + 1)}))
    assert error.field == field
    assert str(limit) in error.message


def test_an_unknown_parameter_is_quoted_short() -> None:
    error = completion_error(completion_body(**{"x" * 10_000: 1}))
    assert len(error.field) <= 64 and error.field.endswith("…")
    assert len(error.message) < 150


def test_stream_options_without_stream_is_refused() -> None:
    # As vLLM: include_usage on a non-streamed answer is a caller's mistake, not ignored.
    for error in (
        chat_error(chat_body(stream_options={"include_usage": True})),
        completion_error(completion_body(stream=False, stream_options={"include_usage": True})),
    ):
        assert error.field == "stream_options"
        assert "stream" in error.message


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        ({"type": "json_object", "schema": 123}, "response_format.schema"),
        ({"type": "text", "strict": True}, "response_format.strict"),
        ({"type": 123}, "response_format.type"),
        ({"type": "hiccup"}, "response_format.type"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "shcema": {}}},
            "response_format.json_schema.shcema",
        ),
    ],
)
def test_a_malformed_response_format_is_refused_by_field(
    response_format: dict[str, Any], named: str
) -> None:
    body = parse_chat(json.dumps(chat_body(response_format=response_format)).encode())
    with pytest.raises(InvalidRequestError) as caught:
        structured_output(body)
    assert caught.value.field == named
