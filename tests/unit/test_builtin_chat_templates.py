"""The built-in chat templates (--chat-template NAME) against llama.cpp's own reference: each
renders the conversation of llama.cpp's tests/test-chat-template.cpp exactly as that test
expects llama.cpp's built-in formatter of the same name to (its `expected_output`, the output
of src/llama-chat.cpp). The sources come from the llama-cpp-python sdist the suite unpacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.llamacpp_build import PeerBuildError, ensure_source
from services.contracts.errors import ModelLoadError
from services.text.builtin_chat_templates import (
    ALIASES,
    BUILTIN_CHAT_TEMPLATES,
    builtin_chat_template,
    builtin_for_model,
    builtin_names,
    chat_template_option,
)
from services.text.chat_template import ChatMessage, ChatTemplate

# test-chat-template.cpp's conversation (main_automated_tests), rendered with a generation
# prompt, as it calls llama_chat_apply_template.
CONVERSATION = [
    ChatMessage("system", "You are a helpful assistant"),
    ChatMessage("user", "Hello"),
    ChatMessage("assistant", "Hi there"),
    ChatMessage("user", "Who are you"),
    ChatMessage("assistant", "   I am an assistant   "),
    ChatMessage("user", "Another question"),
]

# Built-in name → the start of the name of the test case whose template llama.cpp detects as
# that built-in.
REFERENCE_CASES = {
    "chatml": "teknium/OpenHermes-2.5-Mistral-7B",
    "llama2": "mistralai/Mistral-7B-Instruct-v0.2 (NOTE: Old pre-v1",
    "llama3": "Llama-3",
    "mistral-v1": "mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1'",
    "mistral-v3": "Mistral-Large-Instruct-2407 (mistralai 'v3'",
    "mistral-v3-tekken": "Mistral-Nemo-Instruct-2407 (mistralai 'v3-tekken'",
    "mistral-v7": "mistralai/Mistral-Large-Instruct-2411 (mistralai 'v7'",
    "phi3": "Phi-3-mini",
    "phi4": "phi-4",
    "gemma": "google/gemma-7b-it",
    "deepseek": "deepseek-ai/deepseek-coder-33b-instruct",
    "deepseek2": "DeepSeek-V2",
    "command-r": "CohereForAI/c4ai-command-r-plus",
    "vicuna": "eachadea/vicuna-13b-1.1",
    "vicuna-orca": "Orca-Vicuna",
}

# Built-ins llama.cpp's test has no case for: their expected text written from
# src/llama-chat.cpp's formatter of that name (checked below to still be what it writes).
TRANSCRIBED = {
    "mistral-v7-tekken": (
        "LLM_CHAT_TEMPLATE_MISTRAL_V7_TEKKEN",
        "[SYSTEM_PROMPT]You are a helpful assistant[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there"
        "</s>[INST]Who are you[/INST]   I am an assistant   </s>[INST]Another question[/INST]",
    ),
    "deepseek3": (
        "LLM_CHAT_TEMPLATE_DEEPSEEK_3",
        "You are a helpful assistant\n\n<｜User｜>Hello<｜Assistant｜>Hi there<｜end▁of▁sentence｜>"
        "<｜User｜>Who are you<｜Assistant｜>   I am an assistant   <｜end▁of▁sentence｜>"
        "<｜User｜>Another question<｜Assistant｜>",
    ),
    "zephyr": (
        "LLM_CHAT_TEMPLATE_ZEPHYR",
        "<|system|>\nYou are a helpful assistant<|endoftext|>\n<|user|>\nHello<|endoftext|>\n"
        "<|assistant|>\nHi there<|endoftext|>\n<|user|>\nWho are you<|endoftext|>\n"
        "<|assistant|>\n   I am an assistant   <|endoftext|>\n<|user|>\nAnother question"
        "<|endoftext|>\n<|assistant|>\n",
    ),
}

_LITERAL = r'(?:U8C\()?"((?:[^"\\]|\\.)*)"'


@pytest.fixture(scope="module")
def llama_cpp_source() -> Path:
    try:
        return ensure_source()
    except PeerBuildError as exc:
        pytest.skip(f"llama.cpp's sources are not available (offline?): {exc}")


def cpp_string(literal: str) -> str:
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'"}
    return re.sub(r"\\(.)", lambda match: escapes[match.group(1)], literal)


def expected_outputs(source: Path) -> dict[str, str]:
    """test-chat-template.cpp's cases: name → expected_output (llama-chat.cpp's rendering)."""
    text = (source / "tests" / "test-chat-template.cpp").read_text(encoding="utf-8")
    pattern = re.compile(
        r"/\* \.name= \*/ " + _LITERAL + r".*?/\* \.expected_output= \*/\s*" + _LITERAL, re.S
    )
    return {cpp_string(m.group(1)): cpp_string(m.group(2)) for m in pattern.finditer(text)}


def rendered(name: str) -> str:
    source = builtin_chat_template(name)
    assert source is not None
    return ChatTemplate(source).render(CONVERSATION, add_generation_prompt=True)


def test_every_builtin_is_checked_against_llama_cpp() -> None:
    assert set(REFERENCE_CASES) | set(TRANSCRIBED) == set(BUILTIN_CHAT_TEMPLATES)
    for family in ("chatml", "llama2", "llama3", "mistral", "gemma", "phi3", "qwen", "deepseek"):
        assert family in builtin_names()


@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_a_builtin_renders_as_llama_cpp_does(llama_cpp_source: Path, name: str) -> None:
    cases = expected_outputs(llama_cpp_source)
    [case] = [case for case in cases if case.startswith(REFERENCE_CASES[name])]
    expected = cases[case]
    assert rendered(name) == expected


@pytest.mark.parametrize("name", sorted(TRANSCRIBED))
def test_a_builtin_without_a_test_case_renders_as_transcribed(
    llama_cpp_source: Path, name: str
) -> None:
    enum, expected = TRANSCRIBED[name]
    chat_cpp = (llama_cpp_source / "src" / "llama-chat.cpp").read_text(encoding="utf-8")
    # The name still selects that formatter in llama.cpp's table.
    assert re.search(rf'\{{\s*"{re.escape(name)}",\s*{enum}\s*\}}', chat_cpp)
    assert rendered(name) == expected


def test_aliases_name_builtins() -> None:
    for alias, name in ALIASES.items():
        assert builtin_chat_template(alias) == BUILTIN_CHAT_TEMPLATES[name]
    assert builtin_chat_template("no-such-template") is None


def test_the_option_takes_a_name_or_a_file(tmp_path: Path) -> None:
    assert chat_template_option("llama3") == BUILTIN_CHAT_TEMPLATES["llama3"]
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_option(str(path)) == "{{ messages[0]['content'] }}"
    with pytest.raises(ModelLoadError) as missing:
        chat_template_option("chatml3")
    assert "'chatml3' is neither a built-in" in str(missing.value)
    assert "llama3" in str(missing.value)  # the names it could have been
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ModelLoadError, match=r"bad\.jinja, line 1"):
        chat_template_option(str(bad))


def test_llmserve_up_refuses_an_unknown_template_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import main

    assert main(["up", "--chat-template", "chatml3"]) == 2
    assert "--chat-template 'chatml3' is neither a built-in" in capsys.readouterr().err


def test_a_builtin_without_a_generation_prompt_ends_with_the_last_turn() -> None:
    source = builtin_chat_template("llama3")
    assert source is not None
    text = ChatTemplate(source).render(CONVERSATION[:3], add_generation_prompt=False)
    assert text.endswith("Hi there<|eot_id|>")


@pytest.mark.parametrize(
    ("architecture", "name", "vocab_size", "tokens", "expected"),
    [
        # The vocabulary's chat markers decide first.
        ("llama", "SmolLM2 135M", 49152, {"<|im_start|>"}, "chatml"),
        ("llama", "Meta Llama 3 8B", 128256, {"<|start_header_id|>"}, "llama3"),
        ("phi3", "Phi 4 mini", 200064, {"<|im_start|>", "<|im_sep|>"}, "phi4"),
        ("llama", "Mistral 7B v0.3", 32768, {"[INST]"}, "mistral-v3"),
        ("gemma2", "Gemma 2", 256000, {"<start_of_turn>"}, "gemma"),
        # Then the name: a Mistral GGUF's architecture is "llama".
        ("llama", "Mistral 7B Instruct v0.2", 32000, set(), "mistral"),
        # Then the architecture; a llama by its vocabulary's size.
        ("llama", "Llama 2 7B Chat", 32000, set(), "llama2"),
        ("llama", "Llama 3 8B", 128256, set(), "llama3"),
        ("qwen2", "Qwen2.5 0.5B", 151936, set(), "qwen"),
        ("gemma", "Gemma 7B", 256000, set(), "gemma"),
        ("phi3", "Phi 3 mini", 32064, set(), "phi3"),
        ("falcon", "Falcon 7B", 65024, set(), None),
    ],
)
def test_the_builtin_that_fits_a_model(
    architecture: str, name: str, vocab_size: int, tokens: set[str], expected: str | None
) -> None:
    assert builtin_for_model(architecture, name, vocab_size, tokens.__contains__) == expected
    if expected is not None:
        assert builtin_chat_template(expected) is not None
