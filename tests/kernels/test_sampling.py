"""Sampling: the torch sampler against a naive sort-based reference and against the
distribution it should draw from; the Triton sampler (interpreter) token-for-token against the
torch sampler on the same exponential draws."""

from __future__ import annotations

import pytest
import torch

from kernels import sampling_torch, triton_sampling


def naive_keep(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, by the book: sort, cut to k, cut at cumulative p, cut below min_p * max."""
    vocab = x.shape[0]
    order = torch.argsort(x.double(), descending=True)
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        probs = torch.softmax(torch.where(keep, x.double(), float("-inf")), dim=0)
        above = 0.0
        for idx in order.tolist():
            if not keep[idx]:
                continue
            if above >= top_p:
                keep[idx] = False
            above += float(probs[idx])
    if min_p > 0:
        probs = torch.softmax(x.double(), dim=0)
        keep &= probs >= min_p * probs.max()
    return keep


ROW_PARAMS = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),  # plain sampling
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.8, 40, 0.5, 0.0),
    (1.0, 20, 0.95, 0.01),
    (0.0, 3, 0.5, 0.1),  # greedy, filters ignored
    (1.0, 1, 1.0, 0.0),  # top-1 == greedy on the scaled logits
]


def batch_params() -> tuple[torch.Tensor, ...]:
    temperature, top_k, top_p, min_p = zip(*ROW_PARAMS, strict=True)
    return (
        torch.tensor(temperature),
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p),
        torch.tensor(min_p),
    )


def test_thresholds_match_naive_filters() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROW_PARAMS), 500, generator=g) * 3
    temperature, top_k, top_p, min_p = batch_params()
    x = sampling_torch.scaled_logits(logits, temperature)
    threshold = sampling_torch.keep_thresholds(x, top_k, top_p, min_p)
    for row, (_, k, p, mp) in enumerate(ROW_PARAMS):
        keep = x[row] >= threshold[row]
        assert torch.equal(keep, naive_keep(x[row], k, p, mp)), f"row {row}"


def test_greedy_fast_path() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    zeros = torch.zeros(4)
    out = sampling_torch.sample_tokens(
        logits, zeros, torch.zeros(4, dtype=torch.int32), torch.ones(4), zeros
    )
    assert torch.equal(out, logits.argmax(-1))


def test_sampled_distribution() -> None:
    """20k draws of one row with top-k 4 and temperature 0.5 follow the filtered softmax."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.4, -1.0])
    n = 20_000
    batch = logits.expand(n, -1)
    out = sampling_torch.sample_tokens(
        batch,
        torch.full((n,), 0.5),
        torch.full((n,), 4, dtype=torch.int32),
        torch.ones(n),
        torch.zeros(n),
        generator=torch.Generator().manual_seed(2),
    )
    freq = torch.bincount(out, minlength=6).double() / n
    expected = torch.softmax(logits[:4].double() / 0.5, dim=0)
    assert freq[4:].sum() == 0
    torch.testing.assert_close(freq[:4], expected, atol=0.015, rtol=0)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize(
    ("vocab", "block_v", "dtype"), [(300, 128, torch.float32), (1000, 1024, torch.float16)]
)
def test_triton_sampler_matches_torch(vocab: int, block_v: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(len(ROW_PARAMS), vocab, generator=g) * 3).to(dtype)
    exponentials = torch.empty(len(ROW_PARAMS), vocab).exponential_(generator=g)
    params = batch_params()
    expected = sampling_torch.sample_tokens(logits, *params, exponentials)
    out = triton_sampling.sample_tokens(logits, *params, exponentials, block_v=block_v)
    assert torch.equal(out, expected)


@pytest.mark.usefixtures("poisoned")
def test_triton_sampler_thresholds_exactly() -> None:
    """With E = exp(2x) the race score is -x, so the draw is the surviving token with the
    *smallest* logit: the sample then reveals each row's threshold exactly."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(ROW_PARAMS), 700, generator=g) * 2
    params = batch_params()
    x = sampling_torch.scaled_logits(logits, params[0])
    exponentials = torch.exp(2 * x)
    out = triton_sampling.sample_tokens(logits, *params, exponentials, block_v=256)
    for row, (temperature, k, p, mp) in enumerate(ROW_PARAMS):
        if temperature <= 0:
            assert out[row] == logits[row].argmax()
            continue
        keep = naive_keep(x[row], k, p, mp)
        smallest_kept = torch.where(keep, x[row], float("inf")).argmin()
        assert out[row] == smallest_kept, f"row {row}"
