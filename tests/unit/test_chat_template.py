"""The chat template renderer's conventions one by one (transformers' rendering as the
reference where it has one), where a model's templates are found, and a model without any:
its chat requests are refused naming `messages`, and --chat-template gives it one."""

from __future__ import annotations

import dataclasses
import datetime as datetime_module
import json
from pathlib import Path
from typing import Any

import pytest

from services.common.model_source import embedded_model_path
from services.contracts.errors import InvalidRequestError, ModelLoadError
from services.text.chat_template import (
    NO_CHAT_TEMPLATE,
    ChatMessage,
    ChatTemplate,
    TextPart,
    read_chat_template_file,
)
from services.text.model_tokenizer import ModelTokenizer

FIXED_NOW = datetime_module.datetime(2024, 2, 29, 8, 15)
USER = [ChatMessage("user", "hi")]
TOOLS = [{"type": "function", "function": {"name": "now", "description": "<time> & date"}}]


def render(source: str, messages: list[ChatMessage] = USER, **options: Any) -> str:
    special_tokens = options.pop("special_tokens", {"bos_token": "<s>", "eos_token": "</s>"})
    template = ChatTemplate(source, special_tokens=special_tokens, clock=lambda: FIXED_NOW)
    return template.render(messages, **options)


def transformers_render(source: str, messages: list[dict[str, Any]], **options: Any) -> str:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=source, **options
    )
    return str(rendered[0])


def refusal(source: str, messages: list[ChatMessage] = USER, **options: Any) -> str:
    with pytest.raises(InvalidRequestError) as error:
        render(source, messages, **options)
    assert error.value.field == "messages"
    return error.value.message


def test_tojson_takes_json_dumps_arguments_and_escapes_no_html() -> None:
    source = (
        "{{ tools | tojson }}\n{{ tools | tojson(indent=2) }}\n"
        "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}\n"
        "{{ 'café' | tojson }} {{ 'café' | tojson(ensure_ascii=true) }}"
    )
    ours = render(source, tools=TOOLS)
    assert '"<time> & date"' in ours and '"café" "caf\\u00e9"' in ours
    expected = transformers_render(source, [{"role": "user", "content": "hi"}], tools=TOOLS)
    assert ours == expected


def test_loop_controls_generation_tags_namespaces_and_dicts_work_as_in_transformers() -> None:
    source = (
        "{%- set ns = namespace(count=0) -%}\n"
        "{%- for message in messages -%}\n"
        "    {%- if message.role == 'system' %}{% continue %}{% endif -%}\n"
        "    {%- if loop.index > 3 %}{% break %}{% endif -%}\n"
        "    {%- set ns.count = ns.count + 1 -%}\n"
        "    {%- generation %}[{{ message.content }}]{% endgeneration -%}\n"
        "{%- endfor -%}\n"
        "{{ ns.count }} {{ dict(a=1) | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    ours = render(source, [ChatMessage(**m) for m in messages])
    assert ours == '[a][b]2 {"a": 1} {"x": 0}'
    assert ours == transformers_render(source, messages)


def test_parts_reach_a_template_that_only_prints_content_joined() -> None:
    parts = [ChatMessage("user", (TextPart("a"), TextPart("b")))]
    assert render("{{ messages[0].content }}", parts) == "ab"
    assert render("{% for p in messages[0]['content'] %}[{{ p.text }}]{% endfor %}", parts) == (
        "[a][b]"
    )


def test_strftime_now_reads_the_given_clock() -> None:
    assert render("{{ strftime_now('%d %B %Y') }}") == "29 February 2024"


def test_the_variables_a_template_sees() -> None:
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ tools is none }}|"
        "{{ documents is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}|"
        "{{ messages[0].content | tojson }}{% for part in messages[0].content %}{% endfor %}"
    )
    # The template loops over the content, so the parts reach it as a list.
    parts = [ChatMessage("user", (TextPart("a"), TextPart("b")))]
    ours = render(source, parts, chat_template_kwargs={"enable_thinking": False})
    assert ours == '<s>|</s>|False|True|True|True|False|[{"type": "text", "text": "a"}, ' + (
        '{"type": "text", "text": "b"}]'
    )
    as_sent = [{"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]}]
    theirs = transformers_render(
        source,
        as_sent,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
        enable_thinking=False,
    )
    assert ours == theirs


def test_extra_variables_override_special_tokens_but_not_the_request() -> None:
    assert render("{{ bos_token }}", chat_template_kwargs={"bos_token": "<B>"}) == "<B>"
    for name in ("messages", "tools", "documents", "add_generation_prompt"):
        with pytest.raises(InvalidRequestError) as error:
            render("x", chat_template_kwargs={name: None})
        assert error.value.field == "chat_template_kwargs"


def test_the_tool_use_template_renders_requests_with_tools() -> None:
    template = ChatTemplate("plain", tool_use_source="tools: {{ tools | length }}")
    assert template.render(USER) == "plain"
    assert template.render(USER, tools=TOOLS) == "tools: 1"
    assert ChatTemplate("{{ tools | length }}").render(USER, tools=TOOLS) == "1"


def test_a_template_refusal_or_failure_names_messages() -> None:
    assert refusal("{{ raise_exception('Roles must alternate') }}") == "Roles must alternate"
    assert "TypeError" in refusal(
        "{% for p in messages[0].content %}{{ 1 + p }}{% endfor %}",
        [ChatMessage("user", (TextPart("a"),))],
    )
    assert "UndefinedError" in refusal("{{ messages[0].name.first }}")


def test_the_sandbox_holds() -> None:
    # Immutable inputs, no private attributes, no underscore names on namespaces.
    assert "SecurityError" in refusal("{{ messages.append(1) }}")
    assert "SecurityError" in refusal("{{ messages.__class__.__mro__ }}")
    assert "SecurityError" in refusal("{% set ns = namespace() %}{% set ns._x = 1 %}")
    assert "SecurityError" in refusal("{% set ns = namespace(_x=1) %}")


def test_messages_are_checked_before_rendering() -> None:
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        render("x", [])
    with pytest.raises(InvalidRequestError) as error:
        render("x", [ChatMessage("user", "a"), ChatMessage("robot", "b")])
    assert error.value.field == "messages[1].role"


def test_a_chat_template_file_is_checked_when_read(tmp_path: Path) -> None:
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template_file(str(good)) == good.read_text()
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}{{ m.content }}")
    with pytest.raises(ModelLoadError, match=r"bad\.jinja, line 2"):
        read_chat_template_file(str(bad))
    with pytest.raises(ModelLoadError, match=r"missing\.jinja"):
        read_chat_template_file(str(tmp_path / "missing.jinja"))


# ---- a model's templates ------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded() -> ModelTokenizer:
    return ModelTokenizer.from_path(embedded_model_path())


def test_a_model_without_a_chat_template_refuses_chat_and_still_encodes(
    embedded: ModelTokenizer,
) -> None:
    description = embedded.describe(
        model_name="m", vocab_size=embedded.vocab_size, max_model_len=64, eos_token_ids=()
    )
    bare = ModelTokenizer.from_description(dataclasses.replace(description, chat_template=None))
    assert bare.chat_template is None
    with pytest.raises(InvalidRequestError) as error:
        bare.apply_chat_template(USER)
    assert (error.value.field, error.value.message) == ("messages", NO_CHAT_TEMPLATE)
    assert "completions work" in NO_CHAT_TEMPLATE and "--chat-template" in NO_CHAT_TEMPLATE
    assert bare.encode("Hello") == embedded.encode("Hello")
    # --chat-template gives it one (the special tokens stay the model's).
    given = bare.with_chat_template("{{ bos_token }}{{ messages[0].content }}")
    assert given.render_chat(USER) == embedded.special_tokens["bos_token"] + "hi"


def hf_directory(directory: Path, embedded: ModelTokenizer, **tokenizer_config: Any) -> Path:
    """A Hugging Face tokenizer directory around the embedded model's tokenizer."""
    directory.mkdir()
    (directory / "tokenizer.json").write_text(embedded.tokenizer.to_str())
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def added_token(content: str) -> dict[str, Any]:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
        "special": True,
    }


def test_a_directory_finds_its_templates_and_special_tokens_as_transformers_does(
    tmp_path: Path, embedded: ModelTokenizer
) -> None:
    transformers = pytest.importorskip("transformers")
    named = hf_directory(
        tmp_path / "named",
        embedded,
        bos_token="<|im_start|>",
        eos_token=added_token("<|im_end|>"),
        pad_token="<|endoftext|>",
        chat_template=[
            {"name": "default", "template": "default {{ messages[0].content }}"},
            {"name": "tool_use", "template": "tool use {{ tools | length }}"},
            {"name": "rag", "template": "rag"},
        ],
    )
    # Files win over tokenizer_config.json, as in transformers.
    files = hf_directory(tmp_path / "files", embedded, chat_template="from the config")
    (files / "chat_template.jinja").write_text("from the file")
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text("tools from a file")
    for directory in (named, files):
        ours = ModelTokenizer.from_path(directory)
        theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
        assert ours.chat_template is not None
        assert ours.chat_template.source == theirs.get_chat_template()
        assert ours.chat_template.tool_use_source == theirs.get_chat_template(tools=TOOLS)
        assert ours.special_tokens == theirs.special_tokens_map
    assert ModelTokenizer.from_path(named).render_chat(USER, tools=TOOLS) == "tool use 1"
    assert ModelTokenizer.from_path(hf_directory(tmp_path / "none", embedded)).chat_template is None
