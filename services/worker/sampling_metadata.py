"""The sampler's per-step input: the batch's sampling parameters as tensors.

Per step the runner turns its persistent batch into `SamplerRow`s and calls
`build_sampling_metadata` (plain Python in, tensors out); sampler.py consumes the result.
Everything is built from scratch each step: cheap when rows use only defaults.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from services.contracts.sampling_params import SamplingParams

# A temperature below this is treated as greedy: dividing logits by ~1e-40 overflows to inf
# and the softmax turns into NaN, while anything this cold is argmax in all but exact ties.
# (vLLM uses the same cut-off.)
GREEDY_TEMPERATURE_EPS = 1e-5

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplerRow:
    """One batch row as the runner sees it this step."""

    sampling: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far, before this step (a resumed request keeps its old output)."""
    eos_token_ids: tuple[int, ...]
    """The model's EOS ids: masked while the output is shorter than min_new_tokens."""


@dataclass(slots=True)
class GrammarMask:
    """Structured output's allowed tokens this step (worker/structured_output/matchers.py)."""

    bitmask: torch.Tensor
    """[>= B, ceil(V / 32)] int32 on the CPU, bit t of row r set = token t allowed; only the
    rows in `rows` are filled."""
    rows: list[int]
    """The constrained rows; every other row is left as it is."""


@dataclass(slots=True)
class SamplingMetadata:
    """The batch's sampling parameters as tensors on the logits' device, plus branch flags.

    Optional fields are None when no row needs that step, so the sampler skips it outright.
    Per-row tensors have B entries; rows that do not use a parameter hold its no-op value
    (temperature 1, top_k V, top_p inf, min_p 0). Penalty tensors cover only the tokens that
    occur in penalty rows.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    is_greedy: torch.Tensor | None
    """[B] bool; None when no row is greedy."""
    temperature: torch.Tensor | None
    """[B] float32; 1.0 on greedy rows; None when every sampled row has temperature 1."""
    top_k: torch.Tensor | None
    """[B] int64, V where off; None when no sampled row truncates by top_k."""
    top_k_is_active: torch.Tensor | None
    """[B] bool, which rows truncate by top_k (they renormalise over their k tokens)."""
    max_top_k: int
    """Largest active top_k among sampled rows (0 if none)."""
    all_sampled_rows_top_k: bool
    """Every sampled row has an active top_k: a topk(max_top_k) replaces any sort."""
    all_sampled_rows_truncate: bool
    """Every sampled row has top_k, top_p < 1 or min_p > 0 (a topk probe may hold them all)."""
    top_p: torch.Tensor | None
    """[B] float32, inf where off (so rounding in the cumsum never drops a token)."""
    min_p: torch.Tensor | None
    """[B] float32, 0 where off."""

    penalty_index: torch.Tensor | None
    """[N] int64 flat index (row * V + token) of each distinct token occurring in a penalty
    row's output (and, for repetition_penalty, prompt). Penalties touch only these N logits,
    a few hundred per row rather than V; the tensors below hold one value per entry."""
    penalty_counts: torch.Tensor | None
    """[N] float32: occurrences of the token in the row's output (0 for prompt-only tokens)."""
    repetition_penalty: torch.Tensor | None
    """[N] float32; None when every penalty row has repetition_penalty 1."""
    presence_penalty: torch.Tensor | None
    """[N] float32."""
    frequency_penalty: torch.Tensor | None
    """[N] float32."""

    min_tokens_rows: torch.Tensor | None
    """With min_tokens_token_ids: (row, token) pairs to set to -inf this step."""
    min_tokens_token_ids: torch.Tensor | None

    logit_bias_index: torch.Tensor | None
    """[N] int64 flat index (row * V + token) of each biased logit, as for the penalties; None
    when no row has a logit_bias."""
    logit_bias: torch.Tensor | None
    """[N] float32, the bias added at each index."""
    allowed_rows: torch.Tensor | None
    """[R] int64 rows restricted to their allowed_token_ids; None when no row is."""
    allowed_index: torch.Tensor | None
    """[M] int64 flat index (row * V + token) of every allowed token of those rows."""

    seeded_rows: tuple[int, ...]
    """Rows with a seed, and per row the generator seed mixed from (seed, output position)."""
    row_seeds: tuple[int, ...]

    logprobs_rows: torch.Tensor | None
    """[L] int64 rows that asked for logprobs, and how many alternatives each wants."""
    num_logprobs: tuple[int, ...]
    max_num_logprobs: int

    grammar_mask: GrammarMask | None = None
    """Set by the runner after building the rest: the grammars' bitmask, None when no row is
    constrained."""

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole answer (the common benchmark case)."""
        return (
            self.all_greedy
            and self.penalty_index is None
            and self.min_tokens_rows is None
            and self.logit_bias_index is None
            and self.allowed_rows is None
            and self.logprobs_rows is None
        )


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (request seed, output position), stable across processes.

    Keyed on the position rather than on a generator carried along with the request, a seeded
    request draws the same token at the same position after a preemption and recompute, and
    whatever else is in the batch. Two rounds of the SplitMix64 finaliser keep nearby seeds and
    positions from giving correlated streams.
    """
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _is_greedy(sampling: SamplingParams) -> bool:
    return sampling.is_greedy or sampling.temperature < GREEDY_TEMPERATURE_EPS


def build_sampling_metadata(
    rows: Sequence[SamplerRow], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Turn the batch's per-row parameters into tensors; cheap when rows use only defaults."""
    num_rows = len(rows)
    params = [row.sampling for row in rows]
    greedy = [_is_greedy(p) for p in params]
    all_greedy = all(greedy)
    any_greedy = any(greedy)

    def row_tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    temperature = top_k = top_k_is_active = top_p = min_p = None
    max_top_k = 0
    all_sampled_rows_top_k = all_sampled_rows_truncate = False
    if not all_greedy:
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        # Greedy rows get no-op values: they take the argmax and their probabilities are unused.
        if any(p.temperature != 1.0 for p in sampled):
            temperature = row_tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
            )
        # top_k of 0, -1 or >= V keeps every token.
        active_k = [
            0 if g or not 0 < p.top_k < vocab_size else p.top_k
            for p, g in zip(params, greedy, strict=True)
        ]
        if any(active_k):
            top_k = torch.tensor(
                [k or vocab_size for k in active_k], dtype=torch.int64, device=device
            )
            top_k_is_active = torch.tensor([k > 0 for k in active_k], device=device)
            max_top_k = max(active_k)
            all_sampled_rows_top_k = all(
                k > 0 for k, g in zip(active_k, greedy, strict=True) if not g
            )
        all_sampled_rows_truncate = all(
            k > 0 or p.top_p < 1.0 or p.min_p > 0.0
            for p, k, g in zip(params, active_k, greedy, strict=True)
            if not g
        )
        if any(p.top_p < 1.0 for p in sampled):
            top_p = row_tensor(
                [
                    math.inf if g or p.top_p >= 1.0 else p.top_p
                    for p, g in zip(params, greedy, strict=True)
                ]
            )
        if any(p.min_p > 0.0 for p in sampled):
            min_p = row_tensor([0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)])

    penalties = _build_penalties(rows, vocab_size, device)

    min_tokens_rows = min_tokens_token_ids = None
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.sampling.min_new_tokens:
            # EOS is masked even with ignore_eos: min_new_tokens is about the length, and a
            # sampled EOS that is then ignored would still be a token nobody asked for.
            ids = {t for t in (*row.eos_token_ids, *row.sampling.stop_token_ids) if t < vocab_size}
            allowed = row.sampling.allowed_token_ids
            if allowed is not None and ids.issuperset(allowed):
                # Only ending tokens are allowed: masking them would leave the row nothing to
                # sample, so the allow-list wins over min_new_tokens.
                ids = set()
            mask_ids.extend(sorted(ids))
            mask_rows.extend([i] * len(ids))
    if mask_rows:
        min_tokens_rows = torch.tensor(mask_rows, dtype=torch.int64, device=device)
        min_tokens_token_ids = torch.tensor(mask_ids, dtype=torch.int64, device=device)

    logit_bias_fields = _build_logit_bias(params, vocab_size, device)

    seeded_rows: list[int] = []
    row_seeds: list[int] = []
    for i, (row, g) in enumerate(zip(rows, greedy, strict=True)):
        if not g and row.sampling.seed is not None:
            seeded_rows.append(i)
            row_seeds.append(mix_seed(row.sampling.seed, len(row.output_token_ids)))

    num_logprobs = tuple(p.logprobs for p in params)
    logprobs_row_list = [i for i, n in enumerate(num_logprobs) if n > 0]
    logprobs_rows = (
        torch.tensor(logprobs_row_list, dtype=torch.int64, device=device)
        if logprobs_row_list
        else None
    )

    return SamplingMetadata(
        num_rows=num_rows,
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        is_greedy=torch.tensor(greedy, device=device) if any_greedy and not all_greedy else None,
        temperature=temperature,
        top_k=top_k,
        top_k_is_active=top_k_is_active,
        max_top_k=max_top_k,
        all_sampled_rows_top_k=all_sampled_rows_top_k,
        all_sampled_rows_truncate=all_sampled_rows_truncate,
        top_p=top_p,
        min_p=min_p,
        **penalties,
        min_tokens_rows=min_tokens_rows,
        min_tokens_token_ids=min_tokens_token_ids,
        **logit_bias_fields,
        seeded_rows=tuple(seeded_rows),
        row_seeds=tuple(row_seeds),
        logprobs_rows=logprobs_rows,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(num_logprobs, default=0),
    )


def _build_penalties(
    rows: Sequence[SamplerRow], vocab_size: int, device: torch.device
) -> dict[str, torch.Tensor | None]:
    """Per-(row, token) penalty entries for the rows with penalties; other rows pay nothing.

    Built with a sort (torch.unique) over the rows' tokens, not a scatter into [R, V]: the
    logits of tokens that never occurred are left alone, so there is no reason to touch them.
    """
    fields: dict[str, torch.Tensor | None] = dict.fromkeys(
        (
            "penalty_index",
            "penalty_counts",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
    )
    penalised = [i for i, row in enumerate(rows) if row.sampling.has_penalties]
    if not penalised:
        return fields
    chosen = [rows[i] for i in penalised]
    row_offsets = torch.tensor(penalised, dtype=torch.int64, device=device) * vocab_size

    def flat_index(token_lists: list[Sequence[int]]) -> torch.Tensor:
        # Row r's token t is logits.view(-1)[r * V + t]: one index for the whole batch.
        lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
        ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
        return torch.repeat_interleave(row_offsets, lengths) + ids

    output_index, output_counts = torch.unique(
        flat_index([row.output_token_ids for row in chosen]), return_counts=True
    )
    index, counts = output_index, output_counts.float()
    uses_repetition = any(row.sampling.repetition_penalty != 1.0 for row in chosen)
    if uses_repetition:
        # Prompt tokens join the entries with count 0: they get only the repetition penalty.
        prompt_index = flat_index([row.prompt_token_ids for row in chosen])
        index = torch.unique(torch.cat([prompt_index, output_index]))
        counts = torch.zeros(index.shape[0], dtype=torch.float32, device=device)
        counts[torch.searchsorted(index, output_index)] = output_counts.float()

    # Each entry's row, as a position in `chosen`, to spread the per-row parameters.
    entry_row = torch.searchsorted(row_offsets, index // vocab_size * vocab_size)

    def per_entry(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[entry_row]

    fields["penalty_index"] = index
    fields["penalty_counts"] = counts
    fields["presence_penalty"] = per_entry([row.sampling.presence_penalty for row in chosen])
    fields["frequency_penalty"] = per_entry([row.sampling.frequency_penalty for row in chosen])
    if uses_repetition:
        fields["repetition_penalty"] = per_entry(
            [row.sampling.repetition_penalty for row in chosen]
        )
    return fields


def _build_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> dict[str, torch.Tensor | None]:
    """Flat indices for logit_bias and allowed_token_ids; a batch that uses neither builds
    nothing (one truthiness test per row)."""
    fields: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("logit_bias_index", "logit_bias", "allowed_rows", "allowed_index")
    )
    used = [i for i, p in enumerate(params) if p.logit_bias or p.allowed_token_ids is not None]
    if not used:
        return fields
    bias_index: list[int] = []
    bias_values: list[float] = []
    allowed_rows: list[int] = []
    allowed_index: list[int] = []
    for i in used:
        p = params[i]
        if p.logit_bias:
            offset = i * vocab_size
            bias_index.extend(offset + token_id for token_id, _ in p.logit_bias)
            bias_values.extend(bias for _, bias in p.logit_bias)
        if p.allowed_token_ids is not None:
            offset = i * vocab_size
            allowed_rows.append(i)
            allowed_index.extend(offset + token_id for token_id in p.allowed_token_ids)
    if bias_index:
        fields["logit_bias_index"] = torch.tensor(bias_index, dtype=torch.int64, device=device)
        fields["logit_bias"] = torch.tensor(bias_values, dtype=torch.float32, device=device)
    if allowed_rows:
        fields["allowed_rows"] = torch.tensor(allowed_rows, dtype=torch.int64, device=device)
        fields["allowed_index"] = torch.tensor(allowed_index, dtype=torch.int64, device=device)
    return fields
