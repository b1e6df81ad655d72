"""Local JSON-schema definitions (`$defs`, `definitions`) lifted to the root of a schema that
nests several: a `$ref` such as "#/$defs/Item" resolves from the document root, so a tool's
parameters placed under `anyOf` in tool_choice "required"'s grammar lose their definitions
unless they move to that root, renamed per tool so two tools' `Item` cannot collide."""

from __future__ import annotations

from typing import Any

_DEF_KEYS = ("$defs", "definitions")


def hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema without its local definitions, those definitions renamed `prefix + name`), with
    every local `$ref` in both rewritten to the new root names."""
    defs: dict[str, Any] = {}
    for key in _DEF_KEYS:
        for name, definition in (schema.get(key) or {}).items():
            defs[prefix + name] = definition
    body = {key: value for key, value in schema.items() if key not in _DEF_KEYS}
    return _renamed(body, prefix), {name: _renamed(d, prefix) for name, d in defs.items()}


def _renamed(value: Any, prefix: str) -> Any:
    if isinstance(value, dict):
        out = {key: _renamed(item, prefix) for key, item in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str):
            for key in _DEF_KEYS:
                if ref.startswith(f"#/{key}/"):
                    out["$ref"] = f"#/$defs/{prefix}{ref.removeprefix(f'#/{key}/')}"
        return out
    if isinstance(value, list):
        return [_renamed(item, prefix) for item in value]
    return value
