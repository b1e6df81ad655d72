"""logit_bias and allowed_token_ids in the worker's sampler: exactly the right logits move, in
a batch mixed with rows that use neither, and the effect on greedy and sampled draws."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.worker.sampler import Sampler, apply_logit_bias, apply_penalties, filtered_probs
from services.worker.sampling_metadata import SamplerRow, build_sampling_metadata

CPU = torch.device("cpu")
VOCAB = 64
EOS = 0


def make_row(output: Sequence[int] = (), **params: Any) -> SamplerRow:
    return SamplerRow(SamplingParams(**params), [1, 2, 3], list(output), (EOS,))


def random_logits(num_rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * scale


def test_a_batch_without_bias_builds_nothing_and_keeps_the_fast_path() -> None:
    rows = [make_row(temperature=0.0), make_row(temperature=0.0, top_k=5)]
    metadata = build_sampling_metadata(rows, VOCAB, CPU)
    assert metadata.logit_bias_index is None and metadata.logit_bias is None
    assert metadata.allowed_rows is None and metadata.allowed_index is None
    assert metadata.is_plain_greedy
    biased = build_sampling_metadata([*rows, make_row(logit_bias={3: 1.0})], VOCAB, CPU)
    assert not biased.is_plain_greedy


def test_bias_lands_exactly_on_its_rows_and_columns() -> None:
    rows = [
        make_row(),  # untouched
        make_row(logit_bias={5: 2.5, 60: -7.0}),
        make_row(temperature=0.0, top_p=0.5),  # untouched, other parameters
        make_row(logit_bias={5: -1.0}, presence_penalty=0.5, output=[9]),
    ]
    logits = random_logits(len(rows))
    metadata = build_sampling_metadata(rows, VOCAB, CPU)
    out = apply_logit_bias(logits.clone(), metadata)
    expected = logits.clone()
    expected[1, 5] += 2.5
    expected[1, 60] -= 7.0
    expected[3, 5] -= 1.0
    assert torch.equal(out, expected)  # bit for bit, every other logit untouched


def test_bias_comes_after_penalties() -> None:
    # The repetition penalty scales a logit: (x / 2) + 3 tells the order from (x + 3) / 2.
    row = make_row(output=[9], repetition_penalty=2.0, logit_bias={9: 3.0})
    logits = random_logits(1)
    logits[0, 9] = 4.0
    out = apply_logit_bias(logits.clone(), build_sampling_metadata([row], VOCAB, CPU))
    assert float(out[0, 9]) == 7.0  # the bias alone, on the raw logit
    probs = filtered_probs(logits.clone(), build_sampling_metadata([row], VOCAB, CPU))
    unbiased = make_row(output=[9], repetition_penalty=2.0)
    expected = apply_penalties(logits.clone(), build_sampling_metadata([unbiased], VOCAB, CPU))
    assert float(expected[0, 9]) == 2.0
    expected[0, 9] += 3.0
    assert torch.allclose(probs, expected.softmax(dim=-1), atol=1e-6)


def test_allowed_token_ids_blank_every_other_token_on_their_rows_only() -> None:
    rows = [make_row(allowed_token_ids=[7, 3, 7]), make_row(), make_row(allowed_token_ids=[63])]
    logits = random_logits(len(rows))
    out = apply_logit_bias(logits.clone(), build_sampling_metadata(rows, VOCAB, CPU))
    assert torch.equal(out[1], logits[1])
    for row, allowed in ((0, [3, 7]), (2, [63])):
        assert torch.equal(out[row, allowed], logits[row, allowed])
        others = [t for t in range(VOCAB) if t not in allowed]
        assert bool((out[row, others] == -math.inf).all())


def test_a_positive_bias_cannot_bring_back_a_disallowed_token() -> None:
    row = make_row(temperature=0.0, allowed_token_ids=[4, 5], logit_bias={6: 100.0})
    token_ids = Sampler(seed=0)(random_logits(1), build_sampling_metadata([row], VOCAB, CPU))
    assert int(token_ids.token_ids[0]) in (4, 5)


@pytest.mark.parametrize("sampled", [False, True])
def test_minus_100_bans_and_plus_100_forces(sampled: bool) -> None:
    params: dict[str, Any] = {"temperature": 1.0} if sampled else {"temperature": 0.0}
    sampler = Sampler(seed=0)
    for step in range(50):
        logits = random_logits(2, seed=step)
        # Make the banned token the clear favourite so that only the bias can remove it.
        top = int(logits[0].argmax())
        logits[0, top] += 10.0
        forced = (top + 17) % VOCAB
        rows = [
            make_row(logit_bias={top: -100.0}, **params),
            make_row(logit_bias={forced: 100.0}, **params),
        ]
        token_ids = sampler(logits, build_sampling_metadata(rows, VOCAB, CPU)).token_ids
        assert int(token_ids[0]) != top
        assert int(token_ids[1]) == forced


def test_allowed_token_ids_restrict_sampling_and_rows_without_keep_their_draws() -> None:
    allowed = [2, 11, 40]
    plain = [make_row(temperature=1.0, seed=5), make_row(temperature=0.7, top_k=10, seed=6)]
    restricted = make_row(temperature=1.0, seed=7, allowed_token_ids=allowed)
    seen: set[int] = set()
    for step in range(200):
        logits = random_logits(3, seed=step)
        alone = Sampler(seed=0)(logits[:2].clone(), build_sampling_metadata(plain, VOCAB, CPU))
        mixed = Sampler(seed=0)(
            logits.clone(), build_sampling_metadata([*plain, restricted], VOCAB, CPU)
        )
        # Seeded rows draw from their own generators: the restricted row next to them
        # changes none of their tokens.
        assert torch.equal(mixed.token_ids[:2], alone.token_ids)
        seen.add(int(mixed.token_ids[2]))
    assert seen == set(allowed)  # every allowed token drawn at some point, nothing else


def test_allowed_distribution_is_the_renormalised_restriction() -> None:
    allowed = [1, 8, 30, 31]
    row = make_row(temperature=0.5, allowed_token_ids=allowed, logit_bias={8: 1.5})
    logits = random_logits(1)
    probs = filtered_probs(logits.clone(), build_sampling_metadata([row], VOCAB, CPU))[0]
    expected_logits = logits[0, allowed].clone()
    expected_logits[1] += 1.5
    expected = (expected_logits / 0.5).softmax(dim=-1)
    assert torch.allclose(probs[allowed], expected, atol=1e-6)
    assert float(probs.sum() - probs[allowed].sum()) == 0.0


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    row = make_row(temperature=0.0, logit_bias={3: 100.0}, logprobs=2)
    logits = random_logits(1)
    output = Sampler(seed=0)(logits.clone(), build_sampling_metadata([row], VOCAB, CPU))
    assert int(output.token_ids[0]) == 3
    raw = logits.log_softmax(dim=-1)[0]
    logprobs = output.logprobs[0]
    assert logprobs is not None
    assert math.isclose(logprobs.token_logprob, float(raw[3]), abs_tol=1e-5)
    assert logprobs.top_token_ids == raw.topk(2).indices.tolist()


def test_min_new_tokens_yields_when_only_ending_tokens_are_allowed() -> None:
    # EOS is the only allowed token and min_new_tokens is not reached: masking it would leave
    # nothing to sample, so the row samples EOS rather than NaN or an arbitrary token.
    row = make_row(temperature=1.0, allowed_token_ids=[EOS], min_new_tokens=4)
    token_ids = Sampler(seed=0)(random_logits(1), build_sampling_metadata([row], VOCAB, CPU))
    assert int(token_ids.token_ids[0]) == EOS
    # With another allowed token, min_new_tokens still masks EOS.
    row = make_row(temperature=0.0, allowed_token_ids=[EOS, 9], min_new_tokens=4)
    logits = random_logits(1)
    logits[0, EOS] = 50.0
    token_ids = Sampler(seed=0)(logits, build_sampling_metadata([row], VOCAB, CPU))
    assert int(token_ids.token_ids[0]) == 9
