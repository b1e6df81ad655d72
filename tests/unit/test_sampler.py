"""The sampler against naive per-row references: truncation sets, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.worker import sampler as sampler_module
from services.worker.sampler import Sampler, apply_penalties, filtered_probs
from services.worker.sampling_metadata import (
    SamplerRow,
    SamplingMetadata,
    build_sampling_metadata,
    mix_seed,
)

CPU = torch.device("cpu")
EOS = 0


def make_row(
    prompt: Sequence[int] = (1, 2, 3),
    output: Sequence[int] = (),
    eos: tuple[int, ...] = (EOS,),
    **params: Any,
) -> SamplerRow:
    return SamplerRow(SamplingParams(**params), list(prompt), list(output), eos)


def metadata_for(rows: Sequence[SamplerRow], vocab_size: int) -> SamplingMetadata:
    return build_sampling_metadata(rows, vocab_size, CPU)


def random_logits(
    num_rows: int, vocab_size: int, seed: int = 0, scale: float = 2.0
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale


def sample(
    logits: torch.Tensor, rows: Sequence[SamplerRow], sampler: Sampler | None = None
) -> torch.Tensor:
    sampler = sampler or Sampler(seed=0)
    return sampler(logits.clone(), metadata_for(rows, logits.shape[-1])).token_ids


# ---- naive references, one row at a time in float64 ----------------------------------------


def reference_support(
    logits_row: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> set[int]:
    """Tokens a row may sample: top-k, then the minimal nucleus of the renormalised rest, then
    min-p relative to the top token."""
    order = torch.argsort(logits_row.double() / temperature, descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_logits = logits_row.double()[order] / temperature
    probs = torch.softmax(kept_logits, dim=0).tolist()
    total, nucleus = 0.0, []
    for token, p in zip(order, probs, strict=True):
        nucleus.append((token, p))
        total += p
        if total >= top_p:
            break
    top = nucleus[0][1]
    return {token for token, p in nucleus if p >= min_p * top and p > 0}


def reference_probs(
    logits_row: torch.Tensor, support: set[int], temperature: float
) -> torch.Tensor:
    mask = torch.full_like(logits_row, -math.inf, dtype=torch.float64)
    ids = torch.tensor(sorted(support))
    mask[ids] = 0.0
    return torch.softmax(logits_row.double() / temperature + mask, dim=0)


def support_of(probs_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


# ---- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax_through_the_fast_path() -> None:
    logits = random_logits(16, 100)
    rows = [make_row(temperature=0.0) for _ in range(16)]
    metadata = metadata_for(rows, 100)
    assert metadata.is_plain_greedy
    before = logits.clone()
    out = Sampler()(logits, metadata)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)  # the fast path does not touch the logits


def test_top_k_1_is_greedy_even_at_high_temperature() -> None:
    logits = random_logits(32, 200, seed=1)
    rows = [make_row(temperature=5.0, top_k=1) for _ in range(32)]
    for seed in range(5):
        assert torch.equal(sample(logits, rows, Sampler(seed=seed)), logits.argmax(dim=-1))


def test_greedy_rows_mixed_with_sampled_rows_take_the_argmax() -> None:
    logits = random_logits(8, 50, seed=2, scale=0.1)  # flat: sampled rows rarely hit argmax
    rows = [make_row(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(8)]
    tokens = sample(logits, rows)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))


# ---- truncation: top-k, top-p, min-p ------------------------------------------------------


def test_top_k_never_samples_outside_the_top_k() -> None:
    vocab_size, k = 300, 7
    logits = random_logits(64, vocab_size, seed=3, scale=0.5)
    rows = [make_row(top_k=k, temperature=1.5) for _ in range(64)]
    allowed = logits.topk(k, dim=-1).indices
    sampler = Sampler(seed=0)
    seen: list[set[int]] = [set() for _ in range(64)]
    for _ in range(50):
        tokens = sampler(logits.clone(), metadata_for(rows, vocab_size)).token_ids
        assert bool((allowed == tokens.unsqueeze(1)).any(dim=1).all())
        for i, t in enumerate(tokens.tolist()):
            seen[i].add(t)
    # Flat logits and 50 draws: nearly every row visits more than one of its k tokens.
    assert sum(len(s) > 1 for s in seen) > 60


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("probe_sizes", [(), (16,)], ids=["sort", "probe"])
def test_top_p_keeps_the_minimal_nucleus(
    top_p: float,
    temperature: float,
    probe_sizes: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A probe of 16 of 64 tokens holds the nucleus when the logits are peaked; the sort path
    # takes anything else. Both must give the reference's set and probabilities.
    monkeypatch.setattr(sampler_module, "TOP_P_PROBE_SIZES", probe_sizes)
    vocab_size = 64
    logits = random_logits(12, vocab_size, seed=4, scale=3.0)
    rows = [make_row(top_p=top_p, temperature=temperature) for _ in range(12)]
    probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    for i in range(12):
        support = reference_support(logits[i], temperature=temperature, top_p=top_p)
        assert support_of(probs[i]) == support
        expected = reference_probs(logits[i], support, temperature)
        torch.testing.assert_close(probs[i].double(), expected, atol=1e-6, rtol=1e-4)


def test_top_p_probe_falls_back_to_sort_when_the_nucleus_is_wide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sampler_module, "TOP_P_PROBE_SIZES", (4,))
    calls: list[str] = []
    real_sort = torch.Tensor.sort

    def counting_sort(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append("sort")
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    vocab_size = 64
    flat = random_logits(2, vocab_size, seed=5, scale=0.01)  # the nucleus of 0.9 is ~58 tokens
    rows = [make_row(top_p=0.9) for _ in range(2)]
    probs = filtered_probs(flat.clone(), metadata_for(rows, vocab_size))
    assert calls == ["sort"]
    for i in range(2):
        assert support_of(probs[i]) == reference_support(flat[i], top_p=0.9)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.9])
def test_min_p_drops_tokens_below_the_threshold(min_p: float) -> None:
    vocab_size = 80
    logits = random_logits(10, vocab_size, seed=6, scale=2.0)
    rows = [make_row(min_p=min_p, temperature=0.8) for _ in range(10)]
    probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    for i in range(10):
        raw = torch.softmax(logits[i].double() / 0.8, dim=0)
        assert support_of(probs[i]) == set(
            torch.nonzero(raw >= min_p * raw.max()).flatten().tolist()
        )


def test_top_k_then_top_p_renormalises_over_the_top_k() -> None:
    vocab_size = 100
    logits = random_logits(6, vocab_size, seed=7, scale=1.0)
    rows = [make_row(top_k=10, top_p=0.7, min_p=0.05) for _ in range(6)]
    probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    for i in range(6):
        support = reference_support(logits[i], top_k=10, top_p=0.7, min_p=0.05)
        assert support_of(probs[i]) == support
        torch.testing.assert_close(
            probs[i].double(), reference_probs(logits[i], support, 1.0), atol=1e-6, rtol=1e-4
        )


@pytest.mark.parametrize("probe_sizes", [(), (16,)], ids=["sort", "probe"])
def test_top_p_after_top_k_uses_the_top_k_mass_in_every_layout(
    probe_sizes: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_module, "TOP_P_PROBE_SIZES", probe_sizes)
    vocab_size = 64
    # Row 0: the top 3 hold ~19% of the whole mass but 50/31/19% of the top-3 mass, so a
    # nucleus of 0.6 is {0, 1} only if top-p sees the renormalised top-k distribution.
    # Row 1 (top-p alone, peaked) makes the batch take the probe or the sort.
    logits = torch.zeros(2, vocab_size)
    logits[0, :3] = torch.tensor([2.0, 1.5, 1.0])
    logits[1, 5] = 12.0
    rows = [make_row(top_k=3, top_p=0.6), make_row(top_p=0.9)]
    probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    assert support_of(probs[0]) == reference_support(logits[0], top_k=3, top_p=0.6) == {0, 1}
    assert support_of(probs[1]) == {5}


MIXED_PARAMS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"top_k": 3},
    {"top_p": 0.5, "temperature": 0.7},
    {"min_p": 0.3},
    {"temperature": 1.3},
    {"top_k": 20, "top_p": 0.8},
    {"top_k": 1, "temperature": 2.0},
    {"top_p": 0.95, "min_p": 0.02, "temperature": 1.1},
]


@pytest.mark.parametrize("probe_sizes", [(), (16,)], ids=["sort", "probe"])
def test_mixed_rows_each_follow_their_own_parameters(
    probe_sizes: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_module, "TOP_P_PROBE_SIZES", probe_sizes)
    vocab_size = 64
    logits = random_logits(len(MIXED_PARAMS), vocab_size, seed=8, scale=2.5)
    rows = [make_row(**params) for params in MIXED_PARAMS]
    batch_probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    for i, params in enumerate(MIXED_PARAMS):
        alone = filtered_probs(logits[i : i + 1].clone(), metadata_for([rows[i]], vocab_size))
        torch.testing.assert_close(batch_probs[i], alone[0], atol=1e-6, rtol=1e-5)
        if rows[i].sampling.is_greedy:
            assert support_of(batch_probs[i]) == {int(logits[i].argmax())}
        else:
            keys = ("temperature", "top_k", "top_p", "min_p")
            support = reference_support(logits[i], **{k: v for k, v in params.items() if k in keys})
            assert support_of(batch_probs[i]) == support

    # And the draws themselves stay inside each row's own support.
    sampler = Sampler(seed=1)
    supports = [support_of(batch_probs[i]) for i in range(len(rows))]
    for _ in range(100):
        tokens = sampler(logits.clone(), metadata_for(rows, vocab_size)).token_ids.tolist()
        for token, support in zip(tokens, supports, strict=True):
            assert token in support


def test_top_k_rows_next_to_unbounded_rows_use_a_threshold_without_sorting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_sort(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("top-k without top-p must not sort the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    vocab_size = 50
    logits = random_logits(3, vocab_size, seed=9)
    rows = [make_row(top_k=4), make_row(), make_row(top_k=9, min_p=0.1)]
    probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    assert support_of(probs[0]) == reference_support(logits[0], top_k=4)
    assert support_of(probs[1]) == set(range(vocab_size))
    assert support_of(probs[2]) == reference_support(logits[2], top_k=9, min_p=0.1)


# ---- the draw: seeds and frequencies ------------------------------------------------------


def test_same_seed_and_position_give_the_same_token_whatever_the_batch() -> None:
    vocab_size = 500
    logits = random_logits(1, vocab_size, seed=10, scale=0.3)[0]  # flat: draws vary by seed
    for seed in range(40):
        seeded = make_row(output=[5] * 7, seed=seed, top_k=100, top_p=0.9, temperature=0.9)
        alone = sample(logits.unsqueeze(0), [seeded], Sampler(seed=123))[0]

        # Different neighbours force a different truncation layout (sort instead of topk),
        # another position in the batch and another sampler generator.
        others = random_logits(5, vocab_size, seed=seed + 100)
        batch_logits = torch.cat([others[:3], logits.unsqueeze(0), others[3:]])
        neighbours = [make_row(), make_row(top_p=0.5), make_row(temperature=0.0)]
        neighbours += [make_row(seed=seed + 1), make_row(min_p=0.2)]
        batch_rows = [*neighbours[:3], seeded, *neighbours[3:]]
        in_batch = sample(batch_logits, batch_rows, Sampler(seed=seed))[3]

        # A preempted and recomputed request: another prompt length, same output position.
        resumed = make_row(
            prompt=list(range(40)),
            output=[9] * 7,
            seed=seed,
            top_k=100,
            top_p=0.9,
            temperature=0.9,
        )
        again = sample(logits.unsqueeze(0), [resumed], Sampler())[0]

        assert alone == in_batch == again

        # Top-k alone samples over its sorted top k; next to an untruncated row and with no
        # top-p in the batch it samples over the unsorted vocabulary.
        top_k_only = make_row(output=[5] * 7, seed=seed, top_k=100, temperature=0.9)
        sorted_alone = sample(logits.unsqueeze(0), [top_k_only])[0]
        unsorted_batch = sample(
            torch.cat([others[:1], logits.unsqueeze(0)]), [make_row(), top_k_only], Sampler()
        )[1]
        assert sorted_alone == unsorted_batch


def test_same_seed_at_different_positions_draws_different_tokens() -> None:
    vocab_size = 1000
    logits = torch.zeros(1, vocab_size)  # uniform: any repeat is chance (p = 1/1000)
    tokens = [
        int(sample(logits, [make_row(output=[1] * position, seed=7)], Sampler())[0])
        for position in range(40)
    ]
    assert len(set(tokens)) >= 36
    assert mix_seed(7, 0) != mix_seed(7, 1) != mix_seed(8, 0)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 99.9th percentile of chi-square with 7 degrees of freedom; the seeds are fixed, so this is a
# deterministic check that would fail on a biased draw (e.g. the wrong noise distribution).
CHI2_7_DOF_999 = 24.32


@pytest.mark.parametrize(
    "params",
    [{}, {"temperature": 0.6}, {"top_p": 0.8}, {"top_k": 5, "temperature": 1.4}],
    ids=["plain", "cold", "top_p", "top_k"],
)
def test_draw_frequencies_match_the_distribution(params: dict[str, Any]) -> None:
    vocab_size, num_draws = 8, 40_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = [make_row(**params) for _ in range(num_draws)]
    batch = logits.expand(num_draws, vocab_size).clone()
    expected = filtered_probs(batch[:1].clone(), metadata_for(rows[:1], vocab_size))[0]
    if not params:
        torch.testing.assert_close(expected, logits.softmax(dim=0))
    tokens = sample(batch, rows, Sampler(seed=0))
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    assert chi_square(counts, expected.double()) < CHI2_7_DOF_999


def test_seeded_draws_across_seeds_match_the_distribution() -> None:
    vocab_size, num_draws = 8, 4000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = [make_row(seed=seed, output=[3] * (seed % 5)) for seed in range(num_draws)]
    tokens = sample(logits.expand(num_draws, vocab_size).clone(), rows)
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    assert chi_square(counts, logits.softmax(dim=0).double()) < CHI2_7_DOF_999


# ---- penalties and min_new_tokens ---------------------------------------------------------


def test_penalties_change_logits_exactly_as_the_formulas_say() -> None:
    vocab_size = 8
    logits = torch.tensor(
        [
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 0.0],
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 0.0],
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 0.0],
        ]
    )
    rows = [
        # prompt {1, 2}, output 2 once and 3 twice
        make_row(
            prompt=[1, 2],
            output=[2, 3, 3],
            repetition_penalty=2.0,
            presence_penalty=0.5,
            frequency_penalty=0.25,
        ),
        make_row(prompt=[1, 2], output=[2, 3, 3]),  # no penalties: untouched
        make_row(prompt=[5], output=[4, 4, 4, 6], presence_penalty=-1.0),
    ]
    out = apply_penalties(logits.clone(), metadata_for(rows, vocab_size))
    expected = logits.clone()
    # row 0: repetition on {1, 2, 3}; presence on {2, 3}; frequency 1x token 2, 2x token 3
    expected[0, 1] = -1.0 * 2.0
    expected[0, 2] = 2.0 / 2.0 - 0.5 - 0.25 * 1
    expected[0, 3] = -2.0 * 2.0 - 0.5 - 0.25 * 2
    # row 2: presence -1 on {4, 6} (the prompt token 5 is not output: no presence penalty)
    expected[2, 4] = 0.5 + 1.0
    expected[2, 6] = -0.5 + 1.0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_penalties_apply_before_sampling() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    rows = [make_row(prompt=[], output=[0, 0], temperature=0.0, frequency_penalty=2.0)]
    # 5 - 2 * 2 = 1 < 4: the penalty moves the argmax to token 1
    assert int(sample(logits, rows)[0]) == 1


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab_size = 10
    logits = torch.zeros(1, vocab_size)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0  # a stop id
    logits[0, 3] = 8.0
    short = make_row(output=[4], min_new_tokens=2, stop_token_ids=(7,), temperature=0.0)
    probs = filtered_probs(logits.clone(), metadata_for([short], vocab_size))
    assert int(probs[0].argmax()) == 3
    masked = logits.clone()
    Sampler()(masked, metadata_for([short], vocab_size))
    assert masked[0, EOS] == -math.inf and masked[0, 7] == -math.inf

    # ignore_eos does not let EOS through early either; and a sampled row never draws them
    sampled = make_row(output=[], min_new_tokens=3, stop_token_ids=(7,), ignore_eos=True)
    rows = [sampled] * 2000
    tokens = sample(logits.expand(2000, vocab_size).clone(), rows)
    assert not bool(((tokens == EOS) | (tokens == 7)).any())

    reached = make_row(output=[4, 5], min_new_tokens=2, stop_token_ids=(7,), temperature=0.0)
    assert int(sample(logits, [reached])[0]) == EOS


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits_and_are_sorted() -> None:
    vocab_size = 30
    logits = random_logits(4, vocab_size, seed=11)
    rows = [
        make_row(logprobs=3, temperature=0.7, repetition_penalty=1.8, prompt=list(range(30))),
        make_row(),
        make_row(logprobs=5, temperature=0.0),
        make_row(logprobs=1, top_k=4),
    ]
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler(seed=0)(logits.clone(), metadata_for(rows, vocab_size))
    assert out.logprobs[1] is None
    for i, n in [(0, 3), (2, 5), (3, 1)]:
        entry = out.logprobs[i]
        assert entry is not None
        token = int(out.token_ids[i])
        assert entry.token_logprob == pytest.approx(float(raw[i, token]), abs=1e-6)
        top = raw[i].topk(n)
        assert entry.top_token_ids == top.indices.tolist()
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


# ---- numerical edges ----------------------------------------------------------------------


def test_temperature_towards_zero_approaches_greedy() -> None:
    vocab_size = 100
    logits = random_logits(64, vocab_size, seed=12)
    for temperature in (1e-2, 1e-3, 1e-4):  # sampled path: the top token dominates
        rows = [make_row(temperature=temperature) for _ in range(64)]
        assert torch.equal(sample(logits, rows), logits.argmax(dim=-1))
    for temperature in (1e-6, 1e-30, 0.0):  # below the cut-off: greedy, never inf/NaN
        rows = [make_row(temperature=temperature) for _ in range(64)]
        metadata = metadata_for(rows, vocab_size)
        assert metadata.all_greedy
        assert torch.equal(sample(logits, rows), logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"top_k": 5},
        {"top_p": 0.9},
        {"min_p": 0.2},
        {"top_k": 50, "top_p": 0.5},
        {"temperature": 0.3, "repetition_penalty": 1.3, "presence_penalty": 1.0},
    ],
)
def test_minus_inf_logits_never_give_nan_or_masked_tokens(params: dict[str, Any]) -> None:
    vocab_size = 64
    logits = random_logits(16, vocab_size, seed=13)
    masked = torch.rand(16, vocab_size, generator=torch.Generator().manual_seed(0)) < 0.8
    masked[:, 0] = False  # at least one finite logit per row
    masked[-1, 1:] = True  # and one row with a single finite logit
    logits[masked] = -math.inf
    rows = [make_row(output=[1, 2, 2], logprobs=2, **params) for _ in range(16)]
    probs = filtered_probs(logits.clone(), metadata_for(rows, vocab_size))
    assert not bool(probs.isnan().any())
    assert not bool((probs[masked] > 0).any())
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits.clone(), metadata_for(rows, vocab_size))
        assert not bool(masked.gather(1, out.token_ids.unsqueeze(1)).any())
        assert all(e is not None and math.isfinite(e.token_logprob) for e in out.logprobs)
    assert int(out.token_ids[-1]) == 0
