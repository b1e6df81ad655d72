"""A request's tools and its tool choice, as both doors (and the Anthropic one) hand them to
the pipeline, and what they mean for it. Pure: no I/O.

    strict    under auto, a strict tool's calls still follow its schema: a structural tag
              (xgrammar) leaves the text free and holds what follows the family's call
              opening (`<tool_call>`, `{"name": "...`) to the schema.
    none      the model sees the tools (the chat template renders them, as vLLM does by
              default) but its answer is text: nothing is parsed out of it.
    auto      the model decides; its output is parsed by the model family's parser
              (services/text/tool_call_parsers.py): calls become `tool_calls`, the rest is content.
    required  at least one call (one when parallel calls are off); a named function: exactly
              that one. Both are enforced by a grammar (the structured-output engine): the
              answer is a JSON list of {"name", "arguments"} objects whose arguments follow
              each function's schema, or, for a named function, its arguments alone; a small
              model cannot produce an invalid call. This is vLLM's way too: a forced call does
              not need the model's own call syntax, only the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.contracts.errors import InvalidRequestError, quoted
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.tokenizer.schema_defs import hoist_defs

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
"""OpenAI's rule for a function's name (Anthropic's is the same set of characters)."""


class ToolChoiceMode(StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"
    """One named function, always called."""


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """The arguments' JSON Schema (empty: any object)."""
    strict: bool = False
    """The arguments must follow the schema exactly. A forced call always does (its grammar
    is the schema); under `auto` the model's own call syntax is parsed as written."""

    def for_template(self) -> dict[str, Any]:
        """OpenAI's shape, which chat templates are written against (transformers'
        `get_json_schema` makes the same)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters) or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        return dict(self.parameters) or {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[FunctionTool, ...]
    choice: ToolChoiceMode = ToolChoiceMode.AUTO
    function_name: str = ""
    """choice FUNCTION: the function to call."""
    parallel_calls: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION)

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is read for calls (all but `none`)."""
        return self.choice is not ToolChoiceMode.NONE

    def template_tools(self) -> tuple[dict[str, Any], ...]:
        return tuple(tool.for_template() for tool in self.tools)

    def tool(self, name: str) -> FunctionTool | None:
        return next((tool for tool in self.tools if tool.name == name), None)


def check_tool_request(request: ToolRequest, tools_param: str, choice_param: str) -> None:
    """Checks every door makes, errors naming the door's parameters: distinct valid names, a
    choice that names a tool given, a schema that is an object."""
    if len(request.tools) > MAX_TOOLS:
        raise InvalidRequestError(
            tools_param, f"at most {MAX_TOOLS} tools, got {len(request.tools)}"
        )
    seen: set[str] = set()
    for index, tool in enumerate(request.tools):
        if not FUNCTION_NAME.match(tool.name):
            raise InvalidRequestError(
                f"{tools_param}[{index}].name",
                "must be 1-64 characters of A-Z a-z 0-9 _ . -",
            )
        if tool.name in seen:
            raise InvalidRequestError(
                f"{tools_param}[{index}].name", f"{quoted(tool.name)} is given twice"
            )
        seen.add(tool.name)
        if not isinstance(tool.parameters, Mapping):
            raise InvalidRequestError(
                f"{tools_param}[{index}].parameters", "must be a JSON Schema object"
            )
    if request.choice is ToolChoiceMode.FUNCTION and request.tool(request.function_name) is None:
        raise InvalidRequestError(
            choice_param, f"names {quoted(request.function_name)}, which is not in {tools_param}"
        )
    if request.forced and not request.tools:
        raise InvalidRequestError(choice_param, f"asks for a call but {tools_param} is empty")


# A call's opening and closing around its arguments, per parser: (trigger, begin, end); the
# begin holds the function's name.
_CALL_SYNTAX = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "json": ('{"name": "', '{{"name": "{name}", "arguments": ', "}"),
    "llama3_json": ('{"name": "', '{{"name": "{name}", "parameters": ', "}"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{{"name": "{name}", "arguments": ', "}]"),
}


def strict_call_grammar(request: ToolRequest, parser: str) -> StructuredOutput | None:
    """Under auto with a strict tool: a structural tag in the family's call syntax, every
    tool's arguments held to its schema once a call opens (a tool that is not strict: any
    object). None when no tool is strict or the choice is not auto."""
    if request.choice is not ToolChoiceMode.AUTO or not any(t.strict for t in request.tools):
        return None
    trigger, begin, end = _CALL_SYNTAX[parser]
    tags = [
        {
            "type": "tag",
            "begin": begin.format(name=tool.name),
            "content": {
                "type": "json_schema",
                "json_schema": tool.arguments_schema() if tool.strict else {"type": "object"},
            },
            "end": end,
        }
        for tool in request.tools
    ]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not request.parallel_calls,
        },
    }
    return StructuredOutput(StructuredOutputKind.STRUCTURAL_TAG, json.dumps(tag))


def forced_call_grammar(request: ToolRequest) -> StructuredOutput | None:
    """The grammar that makes the answer a valid call (None when the choice forces none)."""
    if request.choice is ToolChoiceMode.FUNCTION:
        tool = request.tool(request.function_name)
        assert tool is not None  # check_tool_request ran
        return StructuredOutput(
            StructuredOutputKind.JSON_SCHEMA, json.dumps(tool.arguments_schema())
        )
    if request.choice is not ToolChoiceMode.REQUIRED:
        return None
    # Each tool's local $defs move to the root (renamed per tool) so its $refs still resolve.
    options: list[dict[str, Any]] = []
    root_defs: dict[str, Any] = {}
    for number, tool in enumerate(request.tools):
        arguments, defs = hoist_defs(tool.arguments_schema(), f"tool{number}_")
        root_defs.update(defs)
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "arguments": arguments,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not request.parallel_calls:
        schema["maxItems"] = 1
    if root_defs:
        schema["$defs"] = root_defs
    return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema))
