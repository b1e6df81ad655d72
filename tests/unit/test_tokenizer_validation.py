"""Edge validation of Generate requests: pure, with a stand-in tokenizer (one id per byte)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from services.contracts.errors import InvalidRequestError, NotFoundError, PromptTooLongError
from services.text.chat_continuation import continued_prompt
from services.text.chat_template import ChatMessage, ChatTemplate
from services.tokenizer.tool_request import FunctionTool, ToolRequest
from services.tokenizer.validation import (
    GenerateInput,
    Limits,
    SamplingInput,
    validate_generate,
)

LIMITS = Limits(
    model_name="tiny",
    max_model_len=32,
    vocab_size=300,
    max_new_tokens_limit=32,
    max_stop_strings=4,
    max_stop_string_len=8,
)


CHATML = (
    "{% if tools %}{{ '<|im_start|>tools\n' + tools | tojson + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ByteTokenizer:
    """One token per UTF-8 byte; a ChatML template that lists the tools first."""

    def __init__(self) -> None:
        self.template = ChatTemplate(CHATML)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        if continue_final_message:
            rendered = self.template.render(messages, add_generation_prompt=False, tools=tools)
            return self.encode(continued_prompt(rendered, messages[-1]))
        return self.encode(self.template.render(messages, tools=tools))


TOKENIZER = ByteTokenizer()


def validate(request: GenerateInput, limits: Limits = LIMITS):  # type: ignore[no-untyped-def]
    return validate_generate(request, limits, TOKENIZER)


def with_sampling(**fields: object) -> GenerateInput:
    return GenerateInput(prompt="hi", sampling=SamplingInput(**fields))  # type: ignore[arg-type]


def test_defaults_and_generated_request_id() -> None:
    validated = validate(GenerateInput(prompt="hi"))
    assert validated.prompt_token_ids == (104, 105)
    assert len(validated.request_id) == 32
    assert validated.sampling.temperature == 1.0
    assert validated.sampling.top_p == 1.0
    assert validated.sampling.top_k == -1
    # The 256 default is capped to what this deployment allows instead of rejected.
    assert validated.sampling.max_new_tokens == LIMITS.max_new_tokens_limit
    assert validated.stop == ()
    assert validated.deadline_s is None


def test_given_fields_pass_through() -> None:
    request = GenerateInput(
        request_id="abc",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingInput(
            temperature=0.0,
            top_k=5,
            seed=7,
            max_new_tokens=8,
            stop=("END", "END", "##"),
            stop_token_ids=(2,),
            logprobs=3,
        ),
        deadline_ms=1500,
        model="tiny",
    )
    validated = validate(request)
    assert validated.request_id == "abc"
    assert validated.prompt_token_ids == (1, 2, 3)
    assert validated.sampling.is_greedy and validated.sampling.seed == 7
    assert validated.sampling.max_new_tokens == 8
    assert validated.sampling.stop_token_ids == (2,)
    assert validated.stop == ("END", "##")  # duplicates dropped, order kept
    assert validated.deadline_s == 1.5


def test_messages_go_through_the_chat_template() -> None:
    roomy = replace(LIMITS, max_model_len=100)
    validated = validate(GenerateInput(messages=(ChatMessage("user", "x"),)), roomy)
    assert bytes(validated.prompt_token_ids).decode().startswith("<|im_start|>user\nx")


def test_tools_reach_the_chat_template() -> None:
    roomy = replace(LIMITS, max_model_len=200)
    tools = ToolRequest((FunctionTool("now"),))
    request = GenerateInput(messages=(ChatMessage("user", "x"),), tool_request=tools)
    text = bytes(validate(request, roomy).prompt_token_ids).decode()
    assert text.startswith(
        '<|im_start|>tools\n[{"type": "function", "function": {"name": "now", "parameters": '
        '{"type": "object", "properties": {}}}}]'
    )


@pytest.mark.parametrize(
    ("request_", "field", "message_part"),
    [
        (GenerateInput(), "prompt", "is empty"),
        (GenerateInput(prompt="a", prompt_token_ids=(1,)), "prompt", "exactly one"),
        (GenerateInput(prompt="a", messages=(ChatMessage("user", "b"),)), "prompt", "exactly one"),
        (GenerateInput(prompt="x" * 32), "prompt", "the prompt has 32 tokens but the context"),
        (GenerateInput(prompt_token_ids=(1, 300)), "prompt_token_ids", "token id 300 at index 1"),
        (GenerateInput(prompt_token_ids=(-5,)), "prompt_token_ids", "outside the vocabulary"),
        (
            GenerateInput(messages=(ChatMessage("user", "a"), ChatMessage("robot", "b"))),
            "messages[1].role",
            "unknown role",
        ),
        (GenerateInput(prompt="a", request_id="x" * 129), "request_id", "at most"),
        (with_sampling(max_new_tokens=0), "sampling.max_new_tokens", "> 0"),
        (with_sampling(max_new_tokens=33), "sampling.max_new_tokens", "over the limit"),
        (with_sampling(temperature=-1.0), "sampling.temperature", ">= 0"),
        (with_sampling(temperature=math.nan), "sampling.temperature", "finite"),
        (with_sampling(top_p=0.0), "sampling.top_p", "(0, 1]"),
        (with_sampling(top_p=1.01), "sampling.top_p", "(0, 1]"),
        (with_sampling(top_k=-2), "sampling.top_k", "-1"),
        (with_sampling(min_p=-0.1), "sampling.min_p", "[0, 1]"),
        (with_sampling(repetition_penalty=0.0), "sampling.repetition_penalty", "> 0"),
        (with_sampling(presence_penalty=2.5), "sampling.presence_penalty", "[-2, 2]"),
        (with_sampling(frequency_penalty=-2.5), "sampling.frequency_penalty", "[-2, 2]"),
        (with_sampling(min_new_tokens=5, max_new_tokens=4), "sampling.min_new_tokens", "in [0"),
        (with_sampling(stop=("a", "b", "c", "d", "e")), "sampling.stop", "at most 4"),
        (with_sampling(stop=("x" * 9,)), "sampling.stop", "over the limit of 8"),
        (with_sampling(stop=("ok", "")), "sampling.stop", "stop string 1 is empty"),
        (with_sampling(stop_token_ids=(300,)), "sampling.stop_token_ids", "outside"),
        (with_sampling(stop_token_ids=(-1,)), "sampling.stop_token_ids", ">= 0"),
        (with_sampling(logprobs=21), "sampling.logprobs", "[0, 20]"),
        (with_sampling(n=0), "sampling.n", "[1, 16]"),
        (with_sampling(n=17), "sampling.n", "[1, 16]"),
    ],
)
def test_bad_requests_name_the_field(
    request_: GenerateInput, field: str, message_part: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate(request_)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert message_part in str(info.value)


def test_prompt_one_short_of_the_context_is_accepted() -> None:
    validated = validate(GenerateInput(prompt="x" * 31))
    assert len(validated.prompt_token_ids) == 31


def test_sampling_is_checked_before_tokenizing() -> None:
    class Exploding(ByteTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            raise AssertionError("tokenized a request with a bad sampling field")

    request = replace(with_sampling(top_p=2.0), prompt="long " * 1000)
    with pytest.raises(InvalidRequestError, match=r"^sampling\.top_p"):
        validate_generate(request, LIMITS, Exploding())


def test_an_unknown_model_is_not_found_naming_the_served_one() -> None:
    with pytest.raises(NotFoundError) as info:
        validate_generate(GenerateInput(prompt="a", model="other"), LIMITS, TOKENIZER)
    assert info.value.field == "model"
    assert "unknown model 'other'" in info.value.message


def test_a_model_naming_a_lora_adapter_runs_with_it() -> None:
    adapters = frozenset({"sql", "chat-fr"})
    request = GenerateInput(prompt="a", model="sql")
    assert validate_generate(request, LIMITS, TOKENIZER, lora_adapters=adapters).lora_name == "sql"
    for base in ("", LIMITS.model_name):
        request = GenerateInput(prompt="a", model=base)
        assert validate_generate(request, LIMITS, TOKENIZER, lora_adapters=adapters).lora_name == ""
    with pytest.raises(NotFoundError) as info:
        validate_generate(
            GenerateInput(prompt="a", model="sqlx"), LIMITS, TOKENIZER, lora_adapters=adapters
        )
    assert info.value.field == "model"
    assert info.value.message.startswith("unknown model 'sqlx'")
    assert "2 LoRA adapters" in info.value.message


# ---- bounds: identifiers and the size of the prompt ------------------------------------------

SIZED = replace(LIMITS, max_prompt_chars=64)


class Untouchable(ByteTokenizer):
    """A tokenizer the request must never reach."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized a request refused by its size")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (GenerateInput(prompt="x" * 65), "prompt"),
        (
            GenerateInput(messages=(ChatMessage("user", "x" * 40), ChatMessage("user", "y" * 25))),
            "messages",
        ),
        (GenerateInput(messages=(ChatMessage("user", ""),) * 32), "messages"),
        # Too many ids is said before any id is checked against the vocabulary.
        (GenerateInput(prompt_token_ids=(10**7,) * 32), "prompt"),
    ],
)
def test_a_prompt_too_large_for_any_tokenization_is_refused_untokenized(
    request_: GenerateInput, field: str
) -> None:
    with pytest.raises(PromptTooLongError) as info:
        validate_generate(request_, SIZED, Untouchable())
    assert info.value.field == field


def test_a_prompt_at_the_size_bound_is_tokenized() -> None:
    roomy = replace(SIZED, max_model_len=100)
    assert len(validate(GenerateInput(prompt="x" * 64), roomy).prompt_token_ids) == 64


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (GenerateInput(prompt="a", tenant_id="t" * 129), "tenant_id"),
        (GenerateInput(prompt="a", tenant_id="a\nb"), "tenant_id"),
        (GenerateInput(prompt="a", model="m" * 257), "model"),
        (GenerateInput(prompt="a", request_id="r\x00"), "request_id"),
        (GenerateInput(messages=(ChatMessage("user", "a"),), prompt_name="p" * 129), "prompt_name"),
        (
            GenerateInput(messages=(ChatMessage("user", "a"),), prompt_name="no spaces"),
            "prompt_name",
        ),
    ],
)
def test_identifiers_are_bounded(request_: GenerateInput, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_generate(request_, LIMITS, Untouchable())
    assert info.value.field == field
    assert len(str(info.value)) < 100


def test_errors_quote_a_short_prefix_of_what_was_sent() -> None:
    long_model = "m" * 256
    with pytest.raises(NotFoundError) as info:
        validate_generate(GenerateInput(prompt="a", model=long_model), LIMITS, TOKENIZER)
    assert "'mmmm" in info.value.message and "…" in info.value.message
    assert len(info.value.message) < 120
    long_role = "r" * 10_000
    with pytest.raises(InvalidRequestError) as error:
        validate(GenerateInput(messages=(ChatMessage(long_role, "x"),)))
    assert error.value.field == "messages[0].role"
    assert len(error.value.message) < 150


def test_n_defaults_to_one_and_passes_through() -> None:
    assert validate(with_sampling()).sampling.n == 1
    assert validate(with_sampling(n=16)).sampling.n == 16
