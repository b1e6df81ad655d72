"""Speculation under a grammar, on the worker's matchers with a real xgrammar: a draft is cut
before the first token the grammar refuses and after one that completes it, the matcher ends
as it started, each verified row gets the mask after the drafts before it, accepted drafts
advance the matcher, and a gated grammar drafts up to its opening tag."""

from __future__ import annotations

import pytest

from services.common.grammar import GrammarCompiler
from services.common.model_source import embedded_model_path
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.text.model_tokenizer import ModelTokenizer
from services.worker.structured_output.matchers import GrammarGate, GrammarMatchers
from tests.unit.test_structured_output import _allowed

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_path(embedded_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer: ModelTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, (EOS,))


def ids(tokenizer: ModelTokenizer, *chars: str) -> list[int]:
    return [tokenizer.encode(c, add_special_tokens=False)[0] for c in chars]


def matchers_for(compiler: GrammarCompiler, spec: StructuredOutput) -> GrammarMatchers:
    matchers = GrammarMatchers(compiler)
    sampling = SamplingParams(structured_output=spec)
    matchers.apply(
        BatchPlan(
            0,
            new_sequences=[
                NewSequence("re", [5], 1, [0], 0, sampling),
                NewSequence("free", [5], 1, [0], 0, SamplingParams()),
            ],
        )
    )
    return matchers


def test_drafts_are_cut_where_the_grammar_refuses(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer
) -> None:
    matchers = matchers_for(compiler, StructuredOutput(StructuredOutputKind.REGEX, "abc"))
    a, b, c, x = ids(tokenizer, "a", "b", "c", "x")
    free = [x, x, x]
    cut = matchers.cut_drafts({"re": [a, b, x, c], "free": free})
    assert cut == {"re": [a, b], "free": free}
    # Refused at once: no draft at all. Completed: nothing after the EOS.
    assert matchers.cut_drafts({"re": [x, a]}) == {}
    assert matchers.cut_drafts({"re": [a, b, c, EOS, a]}) == {"re": [a, b, c, EOS]}
    # The matcher rolled back: the first row still allows only "a".
    mask = matchers.fill(["re"])
    assert mask is not None
    vocab = tokenizer.vocab_size
    assert all(tokenizer.decode([t]).startswith("a") for t in _allowed(mask.bitmask[0], vocab))


def test_each_row_is_masked_after_the_drafts_before_it(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer
) -> None:
    matchers = matchers_for(compiler, StructuredOutput(StructuredOutputKind.REGEX, "ab(c|d)"))
    a, b, c = ids(tokenizer, "a", "b", "c")
    # Rows: free (1 row, 1 draft -> 2 rows), then re (2 drafts -> 3 rows): re starts at 2.
    mask = matchers.fill(["free", "re"], {"free": [7], "re": [a, b]})
    assert mask is not None and mask.rows == [2, 3, 4]
    vocab = tokenizer.vocab_size
    assert {tokenizer.decode([t]) for t in _allowed(mask.bitmask[4], vocab)} == {"c", "d"}
    assert all(tokenizer.decode([t]).startswith("b") for t in _allowed(mask.bitmask[3], vocab))
    # Both drafts accepted, then "c" sampled: only the EOS is left.
    matchers.accept({"re": c, "free": 9}, {"re": [a, b]})
    mask = matchers.fill(["re"])
    assert mask is not None and _allowed(mask.bitmask[0], vocab) == {EOS}


def test_a_gated_grammar_drafts_up_to_its_opening_tag(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer
) -> None:
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    spec = StructuredOutput(StructuredOutputKind.REGEX, "ab", starts_after=end)
    matchers = matchers_for(compiler, spec)
    thinking = tokenizer.encode("I ponder", add_special_tokens=False)
    a = ids(tokenizer, "a")
    draft = [*thinking, *end, *a]
    assert matchers.cut_drafts({"re": draft}) == {"re": [*thinking, *end[:-1]]}
    assert matchers.fill(["re"], {"re": [*thinking, *end[:-1]]}) is None  # all free
    # The gate opens on an accepted draft path: the grammar starts right after it.
    matchers.accept({"re": end[-1]}, {"re": [*thinking, *end[:-1]]})
    mask = matchers.fill(["re"])
    assert mask is not None
    vocab = tokenizer.vocab_size
    assert all(tokenizer.decode([t]).startswith("a") for t in _allowed(mask.bitmask[0], vocab))


def test_the_gate_counts_tokens_before_it_opens_without_moving() -> None:
    gate = GrammarGate((1, 2))
    gate.feed(1)
    assert gate.tokens_before_opening([2, 5]) == 0
    assert gate.tokens_before_opening([5, 1, 2]) == 2
    assert gate.tokens_before_opening([5, 5]) == 2
    assert gate.feed(2)  # unchanged by the look-ahead
