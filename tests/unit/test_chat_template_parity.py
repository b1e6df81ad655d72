"""Chat templates render here exactly as Hugging Face transformers renders them: every real
model template llama.cpp keeps as test data (Llama 3.x, Qwen2.5/3, Gemma, Phi, Mistral,
DeepSeek ...), on the same conversations, with the same special tokens and the same date. A
conversation a template refuses is refused by both, ours naming `messages`.

The templates come from the llama-cpp-python sdist the llama.cpp benchmarks use, downloaded
once into the cache (benchmarks.llamacpp_build.ensure_source)."""

from __future__ import annotations

import datetime as datetime_module
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.llamacpp_build import ensure_source
from services.contracts.errors import InvalidRequestError
from services.text.chat_template import ChatMessage, ChatTemplate, TextPart

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

FIXED_NOW = datetime_module.datetime(2025, 7, 26, 9, 30)

SPECIAL_TOKENS = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]

SYSTEM = {
    "role": "system",
    "content": 'You are a terse assistant. Use <b>no</b> markup & "quotes".',
}
USER = {"role": "user", "content": "Hello there! What's 2+2?"}
ASSISTANT = {"role": "assistant", "content": "4."}
USER_AGAIN = {"role": "user", "content": "And in French, s'il vous plaît?"}
USER_PARTS = {
    "role": "user",
    "content": [{"type": "text", "text": "Describe this:"}, {"type": "text", "text": " a cat."}],
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system+user": [SYSTEM, USER],
    "user": [USER],
    "multi-turn": [SYSTEM, USER, ASSISTANT, USER_AGAIN],
    "ends with assistant": [USER, ASSISTANT],
    "text parts": [SYSTEM, USER_PARTS],
}
TOOL_CONVERSATIONS = ("system+user", "user", "multi-turn")

# Extra variables (vLLM's chat_template_kwargs), tried on the templates that read them.
TEMPLATE_KWARGS = (
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"thinking": True},
    {"reasoning_effort": "low"},
)


@dataclass(frozen=True, slots=True)
class Case:
    conversation: str
    add_generation_prompt: bool
    with_tools: bool
    kwargs: tuple[tuple[str, Any], ...]

    def __str__(self) -> str:
        extras = [f"generation prompt {'on' if self.add_generation_prompt else 'off'}"]
        if self.with_tools:
            extras.append("tools")
        extras += [f"{name}={value!r}" for name, value in self.kwargs]
        return f"{self.conversation} ({', '.join(extras)})"


def cases_for(source: str) -> Iterator[Case]:
    kwarg_sets: list[dict[str, Any]] = [{}]
    kwarg_sets += [kwargs for kwargs in TEMPLATE_KWARGS if next(iter(kwargs)) in source]
    for kwargs in kwarg_sets:
        for name in CONVERSATIONS:
            tool_options = (
                (False, True) if "tools" in source and name in TOOL_CONVERSATIONS else (False,)
            )
            for with_tools in tool_options:
                for add_generation_prompt in (True, False):
                    yield Case(name, add_generation_prompt, with_tools, tuple(kwargs.items()))


def as_chat_messages(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    def content(value: Any) -> str | tuple[TextPart, ...]:
        if isinstance(value, str):
            return value
        return tuple(TextPart(part["text"]) for part in value)

    return [ChatMessage(message["role"], content(message["content"])) for message in messages]


def our_template(source: str) -> ChatTemplate:
    return ChatTemplate(source, special_tokens=SPECIAL_TOKENS, clock=lambda: FIXED_NOW)


def render_ours(template: ChatTemplate, case: Case) -> str | InvalidRequestError:
    try:
        return template.render(
            as_chat_messages(CONVERSATIONS[case.conversation]),
            add_generation_prompt=case.add_generation_prompt,
            tools=TOOLS if case.with_tools else None,
            chat_template_kwargs=dict(case.kwargs),
        )
    except InvalidRequestError as exc:
        return exc


def joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text parts joined into one string: what a template that only prints content gets."""
    return [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(part["text"] for part in m["content"]),
        }
        for m in messages
    ]


def render_theirs(source: str, case: Case, parts_as_list: bool = True) -> str | Exception:
    """As `apply_chat_template(..., tokenize=False)` renders once it has picked the template,
    given text parts as a list only when the template loops over them (as ours gives them)."""
    conversation = CONVERSATIONS[case.conversation]
    if not parts_as_list:
        conversation = joined(conversation)
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[conversation],
            tools=TOOLS if case.with_tools else None,
            chat_template=source,
            add_generation_prompt=case.add_generation_prompt,
            **SPECIAL_TOKENS,
            **dict(case.kwargs),
        )
    except Exception as exc:  # what the template raised, whatever it is
        return exc
    return str(rendered[0])


@dataclass(slots=True)
class Outcome:
    template: str
    num_equal: int = 0
    num_refused_by_both: int = 0
    mismatches: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def template_files() -> list[Path]:
    source = ensure_source()
    files = sorted((source / "models" / "templates").glob("*.jinja"))
    assert files, f"no templates in {source / 'models' / 'templates'}"
    return files


@pytest.fixture(scope="session")
def outcomes(template_files: list[Path]) -> dict[str, Outcome]:
    class FrozenClock(datetime_module.datetime):
        @classmethod
        def now(cls, tz: datetime_module.tzinfo | None = None) -> FrozenClock:
            return FIXED_NOW  # type: ignore[return-value]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_template_utils, "datetime", FrozenClock)
        return {path.name: compare(path) for path in template_files}


def compare(path: Path) -> Outcome:
    source = path.read_text(encoding="utf-8")
    template = our_template(source)
    outcome = Outcome(path.name)
    for case in cases_for(source):
        ours = render_ours(template, case)
        theirs = render_theirs(source, case, template.reads_content_parts)
        if isinstance(ours, InvalidRequestError) and isinstance(theirs, Exception):
            assert ours.field == "messages"
            outcome.num_refused_by_both += 1
        elif ours == theirs:
            outcome.num_equal += 1
        else:
            outcome.mismatches.append(f"{case}: ours {ours!r:.200} vs transformers {theirs!r:.200}")
    return outcome


def test_every_template_renders_as_transformers_does(outcomes: dict[str, Outcome]) -> None:
    failed = {name: o.mismatches for name, o in outcomes.items() if o.mismatches}
    assert failed == {}


# Each family users bring, by the file that holds it, and a conversation it must render (not
# refuse): a vacuous pass (both sides raising on everything) would prove nothing.
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "system+user",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "system+user",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "system+user",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "system+user",
    "Qwen-Qwen3-0.6B.jinja": "system+user",
    "google-gemma-2-2b-it.jinja": "user",
    "microsoft-Phi-3.5-mini-instruct.jinja": "system+user",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "system+user",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "text parts",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "system+user",
}


@pytest.mark.parametrize(("template", "conversation"), sorted(FAMILIES.items()))
def test_the_families_users_bring_render(
    template_files: list[Path], template: str, conversation: str
) -> None:
    path = next((p for p in template_files if p.name == template), None)
    assert path is not None, f"{template} is not among the templates"
    source = path.read_text(encoding="utf-8")
    template = our_template(source)
    for with_tools in (False, True) if "tools" in source else (False,):
        case = Case(conversation, True, with_tools, ())
        rendered = render_ours(template, case)
        assert isinstance(rendered, str), f"{case}: {rendered}"
        assert "Hello there" in rendered or "Describe this" in rendered
        if with_tools:
            assert "get_weather" in rendered


def test_a_template_refusal_names_messages(template_files: list[Path]) -> None:
    # Gemma 2 has no system role: its template says so with raise_exception.
    path = next(p for p in template_files if p.name == "google-gemma-2-2b-it.jinja")
    template = our_template(path.read_text(encoding="utf-8"))
    refused = render_ours(template, Case("system+user", True, False, ()))
    assert isinstance(refused, InvalidRequestError)
    assert refused.field == "messages"
    assert "System role not supported" in refused.message


@pytest.mark.parametrize(
    "template",
    ["meta-llama-Llama-3.1-8B-Instruct.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja"],
)
def test_text_parts_reach_a_printing_template_joined(
    template_files: list[Path], template: str
) -> None:
    """Templates that only print content get OpenAI's text parts as one string (vLLM's
    'auto' content format), so clients that send parts are served, not refused or garbled."""
    source = next(p for p in template_files if p.name == template).read_text(encoding="utf-8")
    ours = our_template(source)
    assert not ours.reads_content_parts
    parts = ours.render(as_chat_messages([SYSTEM, USER_PARTS]))
    text = ours.render(as_chat_messages(joined([SYSTEM, USER_PARTS])))
    assert parts == text and "[{" not in parts
