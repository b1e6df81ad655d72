"""Local $defs lifted to the root of tool_choice "required"'s grammar, checked by compiling
the grammar with xgrammar (the structured-output backend) and by the rewritten references."""

from __future__ import annotations

import json

import xgrammar

from services.tokenizer.schema_defs import hoist_defs
from services.tokenizer.tool_request import (
    FunctionTool,
    ToolChoiceMode,
    ToolRequest,
    forced_call_grammar,
)

ITEM_PARAMETERS = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
    "required": ["items"],
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}}}},
}


def test_defs_move_to_the_root_renamed_and_refs_follow() -> None:
    body, defs = hoist_defs(ITEM_PARAMETERS, "tool0_")
    assert "$defs" not in body
    assert body["properties"]["items"]["items"] == {"$ref": "#/$defs/tool0_Item"}
    assert defs == {"tool0_Item": ITEM_PARAMETERS["$defs"]["Item"]}


def test_required_choice_grammar_keeps_each_tools_definitions() -> None:
    tools = (
        FunctionTool(name="order", parameters=ITEM_PARAMETERS),
        FunctionTool(name="refund", parameters=ITEM_PARAMETERS),
    )
    grammar = forced_call_grammar(ToolRequest(tools=tools, choice=ToolChoiceMode.REQUIRED))
    assert grammar is not None
    schema = json.loads(grammar.text)
    assert set(schema["$defs"]) == {"tool0_Item", "tool1_Item"}
    refs = [option["properties"]["arguments"] for option in schema["items"]["anyOf"]]
    assert [r["properties"]["items"]["items"]["$ref"] for r in refs] == [
        "#/$defs/tool0_Item",
        "#/$defs/tool1_Item",
    ]
    xgrammar.Grammar.from_json_schema(grammar.text)  # raised "Cannot find field $defs" before
