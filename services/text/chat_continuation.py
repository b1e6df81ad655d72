"""Continue the conversation's last (assistant) message instead of answering it: an
Anthropic assistant prefill, transformers' `continue_final_message`.

The conversation is rendered whole, without a generation prompt, and cut right after the final
message's text: whatever the template writes to close that turn (an end-of-turn token, a
newline) is dropped, so the model writes on from the last character the client gave.
Surrounding whitespace is not part of the cut, as in transformers: templates often strip the
content they print.
"""

from __future__ import annotations

from services.contracts.errors import InvalidRequestError
from services.text.chat_template import ChatMessage


def continued_prompt(rendered: str, final: ChatMessage) -> str:
    """`rendered` (the whole conversation, no generation prompt) up to the end of the final
    message's text; InvalidRequestError naming `messages` when there is nothing to continue
    or the template does not print that text as sent."""
    text = final.text.strip()
    if not text:
        raise InvalidRequestError("messages", "the final message to continue has no text")
    end = rendered.rfind(text)
    if end < 0:
        raise InvalidRequestError(
            "messages",
            "the chat template does not print the final message's text as sent, so the "
            "answer cannot continue it",
        )
    return rendered[: end + len(text)]
