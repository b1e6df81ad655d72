"""Prompts for `llmserve bench speculative`: the two kinds of request speculative decoding by
prompt lookup is judged on. Pure and seeded: the same seed gives the same chat messages.

    grounded   "rewrite this passage" with a passage of about 400 tokens: the answer quotes
               its context, where n-gram drafts are accepted most (edit, summarise, extract,
               RAG answers)
    chat       open questions with a short prompt: the answer has little to copy, so drafts
               are rare and mostly rejected (what speculation must not slow down)

The passages are built from seeded sentence templates (names, places, years, trades): plain
English prose, distinct for every request so no two share a cached prefix beyond the template.
"""

from __future__ import annotations

import random

from services.text.chat_template import ChatMessage

WORKLOADS = ("grounded", "chat")
PASSAGE_SENTENCES = 18
"""Sentences per passage: about 400 tokens with SmolLM2's tokenizer."""

_NAMES = (
    "Mara Lindqvist", "Tomas Okafor", "Elena Brandt", "Yusuf Haddad", "Ines Moreau",
    "Piotr Novak", "Aiko Tanaka", "Samuel Reyes", "Hanna Berg", "Dario Conti",
)  # fmt: skip
_PLACES = (
    "Alder", "Westmoor", "Carrow Bay", "Lindenfeld", "Port Ellis", "Ravenscar",
    "Millbrook", "Santa Ines", "Kestrel Point", "Oakhurst",
)  # fmt: skip
_TRADES = (
    "bakery", "bicycle repair shop", "bookbindery", "pottery studio", "fish market",
    "printing press", "clock workshop", "tea house", "boatyard", "weaving mill",
)  # fmt: skip
_THINGS = (
    "the old stone bridge", "the harbour wall", "the railway station", "the town square",
    "the river mill", "the lighthouse", "the covered market", "the north gate",
)  # fmt: skip
_TEMPLATES = (
    "{name} arrived in {place} in {year} with little money and a plan to open a {trade}.",
    "The first {trade} in {place} stood next to {thing}, and it closed every winter.",
    "By {year}, more than {number} families in {place} depended on the {trade} for work.",
    "Every morning at {hour} o'clock, {name} unlocked the doors and lit the stove.",
    "The council of {place} voted in {year} to repair {thing}, after a storm damaged it.",
    "Visitors who came to {place} in summer often asked for directions to {thing}.",
    "{name} kept a ledger of every sale, and the ledger still survives in the town archive.",
    "In {year} a flood reached {thing} and ruined the stock of the {trade} overnight.",
    "The {trade} trained {number} apprentices, most of whom later opened shops of their own.",
    "Prices in {place} rose sharply in {year}, and {name} refused to raise them for a year.",
    "Local newspapers described the {trade} as the heart of {place} for half a century.",
    "On market days the street from {thing} to the {trade} was too crowded for carts.",
    "When {name} retired in {year}, the whole street gathered outside {thing} to say goodbye.",
    "The building that housed the {trade} was sold in {year} and turned into a small museum.",
)


def passage(rng: random.Random, num_sentences: int = PASSAGE_SENTENCES) -> str:
    """A paragraph of seeded prose about one town and one trade."""
    place, trade, name = rng.choice(_PLACES), rng.choice(_TRADES), rng.choice(_NAMES)
    sentences = []
    for _ in range(num_sentences):
        template = rng.choice(_TEMPLATES)
        sentences.append(
            template.format(
                name=name if rng.random() < 0.7 else rng.choice(_NAMES),
                place=place,
                trade=trade,
                thing=rng.choice(_THINGS),
                year=rng.randrange(1850, 1990),
                number=rng.randrange(3, 400),
                hour=rng.randrange(4, 9),
            )
        )
    return " ".join(sentences)


def grounded_messages(num_requests: int, seed: int) -> list[list[ChatMessage]]:
    """Requests to rewrite a passage of about 400 tokens, keeping its wording."""
    rng = random.Random(seed)
    return [
        [
            ChatMessage(
                "user",
                "Rewrite the following passage so that it reads well, keeping its facts, names "
                f"and wording:\n\n{passage(rng)}",
            )
        ]
        for _ in range(num_requests)
    ]


_CHAT_QUESTIONS = (
    "Write a short poem about the sea at night.",
    "What are some good habits for learning a new language?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "How do I make a simple tomato soup?",
    "Tell me a story about a fox who wants to fly.",
    "What should I pack for a weekend hiking trip?",
    "Describe a perfect morning in a mountain village.",
    "Why do cats like boxes so much?",
    "Suggest a name for a small coffee shop and explain it.",
    "What is the difference between weather and climate?",
    "Write a friendly note inviting neighbours to a garden party.",
)


def chat_messages(num_requests: int, seed: int) -> list[list[ChatMessage]]:
    """Open questions: short prompts whose answers have little context to copy."""
    rng = random.Random(seed)
    return [[ChatMessage("user", rng.choice(_CHAT_QUESTIONS))] for _ in range(num_requests)]


def workload_messages(workload: str, num_requests: int, seed: int) -> list[list[ChatMessage]]:
    if workload == "grounded":
        return grounded_messages(num_requests, seed)
    if workload == "chat":
        return chat_messages(num_requests, seed)
    raise ValueError(f"workload is one of {WORKLOADS}, got {workload!r}")
