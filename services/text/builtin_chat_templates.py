"""Chat templates known by name, for `--chat-template NAME` (as llama.cpp's server takes them):
a model file without a template of its own (an older GGUF) can still chat.

Each is a Jinja template rendering exactly what llama.cpp's built-in formatter of that name
writes (src/llama-chat.cpp, `llm_chat_apply_template`); tests/unit/test_builtin_chat_templates.py
holds every one against the expected outputs of llama.cpp's own test
(tests/test-chat-template.cpp). Like llama.cpp's, they write no BOS: the tokenizer adds it when
the model asks for one. They show the model roles and text only: tools reach it as system text
(chat_template.tools_as_system_text), a tool message renders as its role's turn.

    chatml      <|im_start|>role\\n...<|im_end|>\\n            (qwen: the same)
    llama2      [INST] ... [/INST]answer</s>              (a system message: text + newline)
    llama3      <|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>
    mistral-v1, -v3, -v3-tekken, -v7, -v7-tekken          (mistral: v1, Mistral 7B v0.1/v0.2)
    phi3, phi4, gemma, deepseek (coder), deepseek2, deepseek3, command-r, zephyr, vicuna,
    vicuna-orca
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from services.contracts.errors import ModelLoadError
from services.text.chat_template import read_chat_template_file

_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# A system message has no markers: its text and a newline, inside the first [INST].
_LLAMA2 = (
    "{%- set ns = namespace(inside=true) -%}"
    "{{- '[INST] ' -}}"
    "{%- for message in messages -%}"
    "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '[INST] ' -}}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- message['content'] + ' [/INST]' -}}"
    "{%- else -%}{{- message['content'] + '</s>' -}}{%- set ns.inside = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

_LLAMA3 = (
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def _mistral(leading: str, trailing: str, trim_answer: bool) -> str:
    """Mistral's v1 / v3 / v3-tekken formats: a turn opens with [INST] (a system message's
    text leads the first), the answer follows [/INST] and ends with </s>."""
    answer = "message['content'] | trim" if trim_answer else "message['content']"
    return (
        "{%- set ns = namespace(inside=false) -%}"
        "{%- for message in messages -%}"
        "{%- if not ns.inside -%}{%- set ns.inside = true -%}"
        f"{{{{- '{leading}[INST]{trailing}' -}}}}"
        "{%- endif -%}"
        "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n\\n' -}}"
        "{%- elif message['role'] == 'user' -%}"
        f"{{{{- message['content'] + '{leading}[/INST]' -}}}}"
        f"{{%- else -%}}{{{{- '{trailing}' + {answer} + '</s>' -}}}}"
        "{%- set ns.inside = false -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


def _mistral_v7(space: str) -> str:
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}"
        f"{{{{- '[SYSTEM_PROMPT]{space}' + message['content'] + '[/SYSTEM_PROMPT]' -}}}}"
        "{%- elif message['role'] == 'user' -%}"
        f"{{{{- '[INST]{space}' + message['content'] + '[/INST]' -}}}}"
        f"{{%- else -%}}{{{{- '{space}' + message['content'] + '</s>' -}}}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


_PHI3 = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

_PHI4 = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant<|im_sep|>' -}}{%- endif -%}"
)

# Gemma has no system role: the system text leads the next user turn.
_GEMMA = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] | trim -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if ns.system and role != 'model' -%}"
    "{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{{- message['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

_DEEPSEEK = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '### Instruction:\\n' + message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '### Response:\\n' + message['content'] + '\\n<|EOT|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### Response:\\n' -}}{%- endif -%}"
)

_DEEPSEEK2 = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\\n\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'Assistant: ' + message['content'] + '<\uff5cend\u2581of\u2581sentence\uff5c>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)

_DEEPSEEK3 = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '<\uff5cUser\uff5c>' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<\uff5cAssistant\uff5c>' + message['content']"
    " + '<\uff5cend\u2581of\u2581sentence\uff5c>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<\uff5cAssistant\uff5c>' -}}{%- endif -%}"
)

_COMMAND_R = (
    "{%- set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>',"
    " 'assistant': '<|CHATBOT_TOKEN|>'} -%}"
    "{%- for message in messages if message['role'] in tokens -%}"
    "{{- '<|START_OF_TURN_TOKEN|>' + tokens[message['role']] + message['content'] | trim"
    " + '<|END_OF_TURN_TOKEN|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}"
    "{%- endif -%}"
)

_ZEPHYR = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def _vicuna(system_prefix: str, system_suffix: str) -> str:
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}"
        f"{{{{- '{system_prefix}' + message['content'] + '{system_suffix}' -}}}}"
        "{%- elif message['role'] == 'user' -%}{{- 'USER: ' + message['content'] + '\\n' -}}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- 'ASSISTANT: ' + message['content'] + '</s>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
    )


BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama2": _LLAMA2,
    "llama3": _LLAMA3,
    "mistral-v1": _mistral(" ", " ", trim_answer=False),
    "mistral-v3": _mistral("", " ", trim_answer=True),
    "mistral-v3-tekken": _mistral("", "", trim_answer=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _PHI3,
    "phi4": _PHI4,
    "gemma": _GEMMA,
    "deepseek": _DEEPSEEK,
    "deepseek2": _DEEPSEEK2,
    "deepseek3": _DEEPSEEK3,
    "command-r": _COMMAND_R,
    "zephyr": _ZEPHYR,
    "vicuna": _vicuna("", "\\n\\n"),
    "vicuna-orca": _vicuna("SYSTEM: ", "\\n"),
}
"""llama.cpp's names (src/llama-chat.cpp, LLM_CHAT_TEMPLATES) → the template."""

ALIASES = {"qwen": "chatml", "mistral": "mistral-v1"}
"""Names llama.cpp's list lacks that users reach for: Qwen's chat format is ChatML; a Mistral
file old enough to ship no template is a v0.1/v0.2 one (the v1 format)."""


def builtin_names() -> list[str]:
    return sorted([*BUILTIN_CHAT_TEMPLATES, *ALIASES])


def builtin_chat_template(name: str) -> str | None:
    """The built-in template called `name` (llama.cpp's spelling, or an alias); None: no
    such built-in (the name is then a file path)."""
    return BUILTIN_CHAT_TEMPLATES.get(ALIASES.get(name, name))


def chat_template_option(value: str) -> str:
    """The template --chat-template names: a built-in's, else the file's at that path
    (ModelLoadError naming it when it is neither, cannot be read or does not compile)."""
    builtin = builtin_chat_template(value)
    if builtin is not None:
        return builtin
    if not Path(value).exists():
        raise ModelLoadError(
            f"--chat-template {value!r} is neither a built-in template "
            f"({', '.join(builtin_names())}) nor a file"
        )
    return read_chat_template_file(value)


# A chat format's marker tokens, as a vocabulary holds them: the surest sign of the format a
# model was tuned on (a "llama" GGUF may be Llama 2, Llama 3, Mistral or SmolLM). First match.
_MARKER_TOKENS = (
    ("<|im_sep|>", "phi4"),
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"),
    ("[SYSTEM_PROMPT]", "mistral-v7"),
    ("[INST]", "mistral-v3"),
    ("<\uff5cUser\uff5c>", "deepseek3"),
    ("<|START_OF_TURN_TOKEN|>", "command-r"),
    ("<|assistant|>", "phi3"),
)

# The file's architecture name (GGUF general.architecture, HF model_type) → its family's format.
_ARCHITECTURE_FORMATS = {
    "qwen2": "qwen",
    "qwen3": "qwen",
    "qwen2moe": "qwen",
    "qwen2_moe": "qwen",
    "qwen3moe": "qwen",
    "qwen3_moe": "qwen",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "mistral": "mistral",
    "deepseek2": "deepseek2",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek3",
    "command-r": "command-r",
    "cohere": "command-r",
}

LLAMA3_MIN_VOCAB = 128_000
"""Llama 3's vocabulary has 128,256 tokens; Llama 2's 32,000."""


def builtin_for_model(
    architecture: str | None,
    name: str,
    vocab_size: int | None,
    has_token: Callable[[str], bool],
) -> str | None:
    """The built-in that fits a model without a template of its own: by the chat markers its
    vocabulary holds, else by its name (a Mistral file says so; its architecture is "llama"),
    else by its architecture (a llama: llama3 or llama2 by the vocabulary's size). None: no
    sign of any."""
    for token, builtin in _MARKER_TOKENS:
        if has_token(token):
            return builtin
    if "mistral" in name.lower():
        return "mistral"
    family = (architecture or "").lower()
    if family == "llama":
        return "llama3" if (vocab_size or 0) >= LLAMA3_MIN_VOCAB else "llama2"
    return _ARCHITECTURE_FORMATS.get(family)
