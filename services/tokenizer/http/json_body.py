"""A request body's bytes → plain JSON values, or InvalidRequestError naming the value at fault
(`messages[0].content`) or the body. Pure.

Pydantic's own JSON parser lets through what a typed field cannot refuse (NaN, Infinity or
1e400 in a float without bounds or inside a JSON Schema) and names no field for a lone
surrogate or an invalid byte. Here the body is strict UTF-8, every number finite, every
string well-formed Unicode, nesting and containers bounded; the doors' schemas then validate
the values (in Python mode: the parse is done once).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.contracts.errors import InvalidRequestError, quoted, shortened

MAX_INT_DIGITS = 64
"""Wider integers fit no field (the widest, seed, is int64); Python refuses to parse ints of
over 4300 digits anyway, with an error that names nothing."""


@dataclass(frozen=True, slots=True)
class JsonLimits:
    """Bounds on a body's shape: the body size (the middleware's) bounds the rest."""

    max_depth: int = 64
    """Most nested arrays and objects (a chat body needs 5; a JSON Schema rarely 20)."""
    max_array_items: int = 1 << 20
    """Most items of one array (token ids of a prompt, allowed_token_ids of a vocabulary)."""
    max_object_members: int = 16384
    """Most members of one object (logit_bias, a schema's properties)."""


class _OversizedInt:
    """Stands for an integer of over MAX_INT_DIGITS digits until the walk names its place."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _OversizedInt:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_INT_DIGITS else _OversizedInt(digits)


def parse_json_body(raw: bytes, limits: JsonLimits = JsonLimits()) -> Any:
    """The body's JSON value, checked (see the module docstring)."""
    if not raw.strip():
        raise InvalidRequestError("", "the body is not valid JSON: it is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            "", f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})"
        ) from None
    try:
        # NaN and Infinity parse to floats and 1e400 to inf: the walk names where they are.
        value = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(
            "", f"the body is nested too deeply (the limit is {limits.max_depth})"
        ) from None
    check_json_value(value, limits)
    return value


def check_json_value(value: Any, limits: JsonLimits = JsonLimits()) -> None:
    """Walks the value without recursion (a deep body must not exhaust the stack)."""
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidRequestError(_field(path), "must be a finite number")
        elif isinstance(item, _OversizedInt):
            raise InvalidRequestError(
                _field(path), f"an integer of {item.digits} digits is out of range"
            )
        elif isinstance(item, (list, dict)):
            if len(path) >= limits.max_depth:
                raise InvalidRequestError(
                    _field(path), f"is nested too deeply (the limit is {limits.max_depth})"
                )
            if isinstance(item, list):
                _check_size(len(item), limits.max_array_items, "items", path)
                # Plain integers need no check: a prompt's million token ids cost no paths.
                stack.extend(
                    (child, (*path, index))
                    for index, child in enumerate(item)
                    if type(child) is not int
                )
            else:
                _check_size(len(item), limits.max_object_members, "members", path)
                for key, child in item.items():
                    if not _well_formed(key):
                        raise InvalidRequestError(
                            _field(path), f"the member name {quoted(key)} is not valid Unicode"
                        )
                    stack.append((child, (*path, key)))


def _check_size(size: int, limit: int, what: str, path: tuple[int | str, ...]) -> None:
    if size > limit:
        raise InvalidRequestError(_field(path), f"has {size} {what}; the limit is {limit}")


def _check_text(text: str, path: tuple[int | str, ...]) -> None:
    if not _well_formed(text):
        # A lone surrogate ("\ud800") cannot be encoded: the tokenizer and every log line
        # would fail on it later.
        raise InvalidRequestError(
            _field(path), "is not valid Unicode (it holds a lone surrogate escape)"
        )


def _well_formed(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field(path: tuple[int | str, ...]) -> str:
    # A path 60 levels deep says no more than its start does.
    return shortened(json_path(path), 96)


def json_path(path: tuple[int | str, ...]) -> str:
    """('messages', 1, 'role') → 'messages[1].role'; a member name that is no identifier
    (a logit_bias key, a schema's property) is quoted: `logit_bias["50256"]`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{quoted(part, 32)}]"
    return out
