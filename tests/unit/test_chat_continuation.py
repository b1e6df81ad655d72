"""Continuing a conversation's final message (services/text/chat_continuation.py): the
rendered conversation is cut right after that message's text, whatever the template writes
to close the turn."""

from __future__ import annotations

import pytest

from services.contracts.errors import InvalidRequestError
from services.text.builtin_chat_templates import builtin_chat_template
from services.text.chat_continuation import continued_prompt
from services.text.chat_template import ChatMessage, ChatTemplate, TextPart

USER = ChatMessage("user", "Name three fruits.")


def render(name: str, messages: list[ChatMessage]) -> str:
    source = builtin_chat_template(name)
    assert source is not None
    return ChatTemplate(source).render(messages, add_generation_prompt=False)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "chatml",
            "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\nThe fruits are",
        ),
        (
            "llama3",
            "<|start_header_id|>user<|end_header_id|>\n\nName three fruits.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nThe fruits are",
        ),
        (
            "gemma",
            "<start_of_turn>user\nName three fruits.<end_of_turn>\n<start_of_turn>model\n"
            "The fruits are",
        ),
    ],
)
def test_the_prompt_ends_with_the_final_message_text(name: str, expected: str) -> None:
    # Trailing whitespace is not part of the cut (templates that trim it, as llama3's).
    final = ChatMessage("assistant", (TextPart("The fruits "), TextPart("are ")))
    assert continued_prompt(render(name, [USER, final]), final) == expected


def test_the_last_occurrence_is_the_one_continued() -> None:
    # The same text earlier in the conversation does not move the cut.
    final = ChatMessage("assistant", "Yes")
    messages = [ChatMessage("user", "Yes"), ChatMessage("assistant", "Yes"), USER, final]
    prompt = continued_prompt(render("chatml", messages), final)
    assert prompt.endswith("<|im_start|>assistant\nYes")
    assert prompt.count("Yes") == 3


def test_nothing_to_continue_or_a_template_that_drops_the_text_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as empty:
        continued_prompt("<|im_start|>assistant\n", ChatMessage("assistant", "  "))
    assert empty.value.field == "messages" and "no text" in empty.value.message
    with pytest.raises(InvalidRequestError) as dropped:
        continued_prompt("<|im_start|>user\nHi<|im_end|>\n", ChatMessage("assistant", "Sure"))
    assert dropped.value.field == "messages" and "cannot continue" in dropped.value.message
