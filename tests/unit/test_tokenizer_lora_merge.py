"""How the tokenizer tier merges the schedulers' answers to a fanned-out LoRA load, unload or
list (services/tokenizer/routing/adapters.py's pure functions)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.contracts.errors import (
    AlreadyExistsError,
    ConflictError,
    DependencyUnavailableError,
    InvalidRequestError,
    NotFoundError,
)
from services.tokenizer.routing.adapter_info import AdapterInfo
from services.tokenizer.routing.adapters import Answer, merged_list, merged_load, merged_unload

BASE = "SmolLM2-135M-Instruct"

SQL = AdapterInfo("sql", "/adapters/sql", rank=8, load_ms=3.0)


def replace_load_ms(info: AdapterInfo, load_ms: float) -> AdapterInfo:
    return replace(info, load_ms=load_ms)


def test_a_load_holds_when_every_answering_scheduler_holds_it() -> None:
    answers = [
        Answer("a:1", SQL),
        Answer("b:1", error=AlreadyExistsError("name: adapter 'sql' is loaded")),
        Answer("c:1", error=DependencyUnavailableError("scheduler c:1 is unavailable")),
        Answer("d:1", replace_load_ms(SQL, 9.0)),
    ]
    merged = merged_load("sql", BASE, answers)
    assert (merged.num_loaded_schedulers, merged.parent, merged.load_ms) == (3, BASE, 9.0)


def test_a_load_loaded_everywhere_already_is_already_exists() -> None:
    already = AlreadyExistsError("name: adapter 'sql' is loaded")
    with pytest.raises(AlreadyExistsError, match=r"^LoRA adapter 'sql' is loaded already"):
        merged_load("sql", BASE, [Answer("a:1", error=already), Answer("b:1", error=already)])


def test_a_refusal_names_the_schedulers_and_what_holds() -> None:
    answers: list[Answer[AdapterInfo]] = [
        Answer("a:1", SQL),
        Answer("b:1", error=ConflictError("scheduler b:1: no LoRA slots")),
        Answer("c:1", error=DependencyUnavailableError("down")),
    ]
    with pytest.raises(ConflictError) as info:
        merged_load("sql", BASE, answers)
    assert str(info.value) == (
        "scheduler b:1: no LoRA slots (refused by b:1; loaded on 1 of 3 schedulers; "
        "1 did not answer)"
    )


def test_the_same_refusal_from_every_scheduler_is_passed_on_as_it_is() -> None:
    refusal = InvalidRequestError("r", "rank 64 is over 16")
    answers: list[Answer[AdapterInfo]] = [
        Answer("a:1", error=refusal),
        Answer("b:1", error=refusal),
    ]
    with pytest.raises(InvalidRequestError) as info:
        merged_load("sql", BASE, answers)
    assert info.value is refusal


def test_no_scheduler_answering_is_unavailable() -> None:
    down: list[Answer[AdapterInfo]] = [Answer("a:1", error=DependencyUnavailableError("down"))]
    with pytest.raises(DependencyUnavailableError):
        merged_load("sql", BASE, down)
    with pytest.raises(DependencyUnavailableError):
        merged_unload("sql", [Answer("a:1", error=DependencyUnavailableError("down"))])
    with pytest.raises(DependencyUnavailableError):
        merged_list(BASE, [Answer("a:1", error=DependencyUnavailableError("down"))])


def test_unload_counts_the_schedulers_that_dropped_it() -> None:
    absent = NotFoundError("name", "no adapter 'sql'")
    assert merged_unload("sql", [Answer("a:1", True), Answer("b:1", error=absent)]) == 1
    with pytest.raises(NotFoundError) as info:
        merged_unload("sql", [Answer("a:1", error=absent), Answer("b:1", error=absent)])
    assert info.value.message == "no LoRA adapter 'sql' is loaded"


def test_the_list_merges_by_name() -> None:
    fr = AdapterInfo("fr", "/adapters/fr", num_running=2)
    answers = [
        Answer("a:1", [SQL, fr]),
        Answer("b:1", [replace_load_ms(SQL, 7.0)]),
        Answer("c:1", error=DependencyUnavailableError("down")),
    ]
    merged = merged_list(BASE, answers)
    assert [(a.name, a.num_loaded_schedulers, a.load_ms, a.parent) for a in merged] == [
        ("fr", 1, 0.0, BASE),
        ("sql", 2, 7.0, BASE),
    ]
    assert merged_list(BASE, []) == []
