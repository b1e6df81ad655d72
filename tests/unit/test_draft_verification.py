"""Draft verification keeps the sampling distribution exact: on a toy vocabulary, the tokens a
verified step emits at each position follow the model's distribution there, whatever the
drafts; greedy verification accepts exactly the drafts that are the argmax."""

from __future__ import annotations

import pytest
import torch

from services.worker.speculative.draft_verification import verify_greedy, verify_sampled

TRIALS = 20_000


def within_sampling_error(counts: torch.Tensor, expected: torch.Tensor, trials: int) -> bool:
    """Every frequency within 4.5 standard errors of its probability (fixed seed: not flaky;
    a wrong rule, e.g. emitting the draft on a miss, is off by tens of errors)."""
    frequency = counts.double() / trials
    error = torch.sqrt(expected * (1 - expected) / trials)
    return bool(((frequency - expected).abs() <= 4.5 * error + 1e-9).all())


def toy_rows(seed: int, num_rows: int, vocab: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(num_rows, vocab, generator=g, dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("drafts", [[1, 3], [0, 0], [5, 2]])
def test_each_position_follows_the_model_distribution(drafts: list[int]) -> None:
    probs = toy_rows(seed=sum(drafts) + 7, num_rows=len(drafts) + 1)
    vocab = probs.shape[1]
    g = torch.Generator().manual_seed(11)
    first = torch.zeros(vocab)
    second_after_draft = torch.zeros(vocab)
    num_first_accepted = 0
    for _ in range(TRIALS):
        verified = verify_sampled(probs, drafts, g)
        assert 1 <= len(verified.token_ids) <= len(drafts) + 1
        assert verified.token_ids[: verified.num_accepted] == drafts[: verified.num_accepted]
        first[verified.token_ids[0]] += 1
        if verified.token_ids[0] == drafts[0]:
            # Position 1 is emitted only after the first draft: p_1 is conditioned on it.
            num_first_accepted += 1
            second_after_draft[verified.token_ids[1]] += 1
    assert within_sampling_error(first, probs[0], TRIALS)
    assert within_sampling_error(second_after_draft, probs[1], num_first_accepted)


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        verified = verify_sampled(probs, [1, 0], g)
        assert verified.token_ids[0] == 1
        assert verified.num_accepted >= 1
    for _ in range(200):
        verified = verify_sampled(probs, [0, 0], g)
        assert verified.token_ids == [1] and verified.num_accepted == 0


def test_the_same_seed_gives_the_same_tokens() -> None:
    probs = toy_rows(seed=3, num_rows=4)
    runs = [
        [verify_sampled(probs, [1, 2, 3], torch.Generator().manual_seed(5)).token_ids]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_greedy_accepts_the_argmax_prefix_then_emits_the_argmax() -> None:
    assert verify_greedy([4, 7, 9], [4, 7]).token_ids == [4, 7, 9]
    assert verify_greedy([4, 7, 9], [4, 8]).token_ids == [4, 7]
    assert verify_greedy([4, 7, 9], [5, 7]).token_ids == [4]
    assert verify_greedy([4], []).token_ids == [4]
    assert verify_greedy([4, 7, 9], [4, 8]).num_accepted == 1


def test_rows_must_match_the_drafts() -> None:
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError):
        verify_sampled(toy_rows(0, 2), [1, 2, 3])
