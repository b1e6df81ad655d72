"""Requests for `llmserve bench spec`: four kinds of traffic speculative decoding meets, each
seeded (the same seed gives the same requests) and varied from request to request, so what the
suffix cache drafts from is earlier traffic of the same kind, never the same answer.

    code_edit    a small Python file in the prompt; the answer rewrites it with one change
    multi_turn   a chat whose earlier assistant turns the last question asks to quote
    json         extraction of a person's record from a sentence, under a JSON schema
    chat         open questions: little to copy (what speculation must not slow down)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from benchmarks.speculative_workload import chat_messages, passage
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.text.chat_template import ChatMessage

WORKLOADS = ("code_edit", "multi_turn", "json", "chat")

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "city": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "trade": {"type": "string", "maxLength": 32},
    },
    "required": ["name", "city", "age", "trade"],
}

_NAMES = ("Mara Lindqvist", "Tomas Okafor", "Elena Brandt", "Yusuf Haddad", "Aiko Tanaka")
_CITIES = ("Porto", "Bergen", "Lagos", "Kyoto", "Valparaiso", "Tallinn")
_TRADES = ("baker", "bookbinder", "potter", "clockmaker", "boat builder")
_IDENTIFIERS = ("total", "count", "items", "result", "value", "price", "limit", "offset")


@dataclass(frozen=True, slots=True)
class SpecRequest:
    messages: list[ChatMessage]
    structured_output: StructuredOutput | None = None


def code_file(rng: random.Random) -> tuple[str, str, str]:
    """A small Python module, and one identifier in it with a new name."""
    names = rng.sample(_IDENTIFIERS, 4)
    functions = []
    for index in range(3):
        a, b = rng.sample(names, 2)
        functions.append(
            f"def step_{index}({a}, {b}):\n"
            f'    """Combine {a} and {b} for stage {index}."""\n'
            f"    if {a} > {rng.randint(2, 99)}:\n"
            f"        {a} = {a} - {b}\n"
            f"    return {a} * {rng.randint(2, 9)} + {b}\n"
        )
    old = names[0]
    return "\n\n".join(functions), old, f"{old}_{rng.choice(('new', 'next', 'kept'))}"


def code_edit(rng: random.Random) -> SpecRequest:
    source, old, new = code_file(rng)
    prompt = (
        f"Rename the variable `{old}` to `{new}` in this file and return the whole file, "
        f"otherwise unchanged:\n\n```python\n{source}```"
    )
    return SpecRequest([ChatMessage("user", prompt)])


def multi_turn(rng: random.Random) -> SpecRequest:
    earlier = passage(rng, num_sentences=6)
    return SpecRequest(
        [
            ChatMessage("user", "Tell me about a small town and its most famous shop."),
            ChatMessage("assistant", earlier),
            ChatMessage("user", "Thanks. Which year did you mention first?"),
            ChatMessage("assistant", "I mentioned a few years; the first one is in my answer."),
            ChatMessage("user", "Quote your first answer again, word for word."),
        ]
    )


def json_extraction(rng: random.Random) -> SpecRequest:
    name, city, trade = rng.choice(_NAMES), rng.choice(_CITIES), rng.choice(_TRADES)
    age = rng.randint(20, 80)
    sentence = f"{name}, a {trade} aged {age}, has lived in {city} for years."
    return SpecRequest(
        [ChatMessage("user", f"Extract name, city, age and trade as JSON: {sentence}")],
        StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(PERSON_SCHEMA)),
    )


def workload_requests(workload: str, num_requests: int, seed: int) -> list[SpecRequest]:
    rng = random.Random(seed)
    if workload == "code_edit":
        return [code_edit(rng) for _ in range(num_requests)]
    if workload == "multi_turn":
        return [multi_turn(rng) for _ in range(num_requests)]
    if workload == "json":
        return [json_extraction(rng) for _ in range(num_requests)]
    if workload == "chat":
        return [SpecRequest(m) for m in chat_messages(num_requests, seed)]
    raise ValueError(f"workload is one of {', '.join(WORKLOADS)}, got {workload!r}")
