"""The worker's sampler: one next token per batch row from the model's last-position logits.

Per step the runner turns its persistent batch into `SamplerRow`s, calls
`build_sampling_metadata` (plain Python in, tensors out) and then `Sampler()(logits, metadata)`.
The order of operations, per row, is the one vLLM and Hugging Face users expect:

    raw logits ──► logprobs (log_softmax of the raw logits, if asked)
        │
        ├─ min_new_tokens: EOS and stop ids -> -inf while the output is too short
        ├─ penalties: repetition (prompt + output), presence, frequency (output)
        ├─ greedy rows: argmax                                     ─┐
        └─ other rows: / temperature -> top-k -> top-p -> min-p     ├─► token_ids [B]
                       -> exponential race argmax(p / E), E ~ Exp(1)┘

Every per-row parameter is a [B] tensor, so a batch mixing greedy, top-k, top-p and min-p rows
costs a handful of batched ops, not a Python loop over rows. The only per-row loops are over
rows with a `seed` (each draws its noise from its own generator) and the final conversion of
logprobs to Python lists.

The metadata holds tensors plus the few Python flags the sampler branches on; everything is
built from scratch each step (see `build_sampling_metadata`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from services.common.sampling_params import SamplingParams
from services.contracts.step import TokenLogprobs

# A temperature below this is treated as greedy: dividing logits by ~1e-40 overflows to inf
# and the softmax turns into NaN, while anything this cold is argmax in all but exact ties.
# (vLLM uses the same cut-off.)
GREEDY_TEMPERATURE_EPS = 1e-5

# Top-p without top-k needs the tokens in probability order. A full sort of V=49152 costs
# ~0.5 s for 256 rows on a 2-core CPU, ~8x a topk(256), while real next-token distributions
# put the nucleus in the first few dozen tokens. So try topk with these sizes first and sort
# the whole vocabulary only when some row's nucleus does not fit in them.
TOP_P_PROBE_SIZES = (256, 2048)

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

    seeded_rows: tuple[int, ...]
    """Rows with a seed, and per row the generator seed mixed from (seed, output position)."""
    row_seeds: tuple[int, ...]

    logprobs_rows: torch.Tensor | None
    """[L] int64 rows that asked for logprobs, and how many alternatives each wants."""
    num_logprobs: tuple[int, ...]
    max_num_logprobs: int

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole answer (the common benchmark case)."""
        return (
            self.all_greedy
            and self.penalty_index is None
            and self.min_tokens_rows is None
            and self.logprobs_rows is None
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[B] int64 on the logits' device."""
    logprobs: list[TokenLogprobs | None]
    """Per row; None where the row's sampling.logprobs is 0."""


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
            mask_ids.extend(sorted(ids))
            mask_rows.extend([i] * len(ids))
    if mask_rows:
        min_tokens_rows = torch.tensor(mask_rows, dtype=torch.int64, device=device)
        min_tokens_token_ids = torch.tensor(mask_ids, dtype=torch.int64, device=device)

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


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Mask EOS and stop ids (in place) on rows that have not reached min_new_tokens."""
    if metadata.min_tokens_rows is not None:
        assert metadata.min_tokens_token_ids is not None
        logits[metadata.min_tokens_rows, metadata.min_tokens_token_ids] = -math.inf
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, presence and frequency penalties, in place, on the occurring tokens only.

    repetition (CTRL / HF, tokens of prompt or output): logit > 0 -> logit / p, else logit * p
    presence (output):  logit -= p  once per distinct token
    frequency (output): logit -= p * count
    """
    index = metadata.penalty_index
    if index is None:
        return logits
    counts = metadata.penalty_counts
    assert counts is not None
    assert metadata.presence_penalty is not None and metadata.frequency_penalty is not None
    if not logits.is_contiguous():
        raise ValueError("apply_penalties needs contiguous logits (it indexes logits.view(-1))")
    flat = logits.view(-1)
    x = flat[index]
    if metadata.repetition_penalty is not None:
        penalty = metadata.repetition_penalty
        x = torch.where(x > 0, x / penalty, x * penalty)
    x -= counts * metadata.frequency_penalty + (counts > 0) * metadata.presence_penalty
    flat[index] = x
    return logits


@dataclass(slots=True)
class _Candidates:
    """Each row's surviving tokens, as unnormalised probabilities and their vocabulary ids.

    `token_ids` None means column j is token j (no truncation needed a sort); otherwise the
    columns are in descending probability order, truncated tokens have probability 0, and the
    surviving tokens of every row form a prefix.
    """

    probs: torch.Tensor
    token_ids: torch.Tensor | None


def _candidate_logits(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(temperature-scaled logits, token ids, full-row logsumexp or None) of the tokens
    truncation may keep, in the cheapest layout that still lets every row truncate exactly:

      every sampled row has top-k  -> topk(max_top_k), already sorted
      no top-p                     -> the vocabulary unsorted; top-k as a k-th value threshold
      top-p and each row truncates -> topk probes (TOP_P_PROBE_SIZES), if they hold every
                                      row's survivors
      otherwise                    -> a full sort

    Dividing by a positive temperature keeps the order, so where the layout selects tokens
    first only the selected logits are scaled.
    """
    vocab_size = logits.shape[-1]
    temperature = metadata.temperature

    def scaled(values: torch.Tensor) -> torch.Tensor:
        return values if temperature is None else values / temperature.unsqueeze(1)

    if metadata.all_sampled_rows_top_k:
        values, ids = logits.topk(metadata.max_top_k, dim=-1)
        return scaled(values), ids, None
    if metadata.top_p is None:
        x = scaled(logits)
        if metadata.top_k is not None:
            x = _mask_below_kth(x, metadata)
        return x, None, None
    if metadata.all_sampled_rows_truncate:
        full_lse = scaled(logits).logsumexp(dim=-1)
        for probe in TOP_P_PROBE_SIZES:
            k = max(probe, metadata.max_top_k)
            if 2 * k > vocab_size:
                break
            values, ids = logits.topk(k, dim=-1)
            values = scaled(values)
            if bool(_probe_covers(values, full_lse, metadata).all()):
                return values, ids, full_lse
    values, ids = logits.sort(dim=-1, descending=True)
    return scaled(values), ids, None


def _mask_below_kth(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Top-k without reordering: drop logits below the row's k-th largest (ties all survive)."""
    assert metadata.top_k is not None and metadata.top_k_is_active is not None
    top_values = x.topk(metadata.max_top_k, dim=-1).values
    last = (metadata.top_k.clamp(max=metadata.max_top_k) - 1).unsqueeze(1)
    kth = top_values.gather(1, last).squeeze(1)
    kth = torch.where(metadata.top_k_is_active, kth, -math.inf)
    return x.masked_fill(x < kth.unsqueeze(1), -math.inf)


def _probe_covers(
    values: torch.Tensor, full_lse: torch.Tensor, metadata: SamplingMetadata
) -> torch.Tensor:
    """[B] bool: every token the row's truncation keeps is among these top `values`."""
    covered = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    if metadata.is_greedy is not None:
        covered |= metadata.is_greedy
    if metadata.top_k_is_active is not None:
        covered |= metadata.top_k_is_active
    if metadata.top_p is not None:
        # The same float32 cumsum the top-p step uses, so "covered" agrees with what it keeps.
        mass = (values - full_lse.unsqueeze(1)).exp().cumsum(dim=-1)[:, -1]
        covered |= mass >= metadata.top_p
    if metadata.min_p is not None:
        # min-p keeps logits >= max + log(min_p); covered if the probe reaches below that.
        floor = values[:, 0] + torch.log(metadata.min_p)
        covered |= values[:, -1] < floor
    return covered


def _truncate(logits: torch.Tensor, metadata: SamplingMetadata) -> _Candidates:
    """Temperature, then top-k, top-p (on the top-k-renormalised distribution), min-p."""
    values, ids, full_lse = _candidate_logits(logits, metadata)

    if metadata.top_k is not None and ids is not None:
        position = torch.arange(values.shape[1], device=values.device)
        values = values.masked_fill(position >= metadata.top_k.unsqueeze(1), -math.inf)

    if full_lse is None:
        probs = values.softmax(dim=-1)
    else:
        # A probe holds only part of the vocabulary: rows truncated by top-k renormalise over
        # their k tokens (all inside the probe); the others keep the full-vocabulary scale.
        lse = full_lse
        if metadata.top_k_is_active is not None:
            lse = torch.where(metadata.top_k_is_active, values.logsumexp(dim=-1), full_lse)
        probs = (values - lse.unsqueeze(1)).exp()

    if metadata.top_p is not None:
        assert ids is not None
        # Keep a token while the mass strictly before it is below top_p: the smallest prefix
        # whose mass reaches top_p (the top token always survives).
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        probs = probs.masked_fill(mass_before >= metadata.top_p.unsqueeze(1), 0.0)

    if metadata.min_p is not None:
        top = probs[:, :1] if ids is not None else probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < metadata.min_p.unsqueeze(1) * top, 0.0)

    if ids is not None:
        # Survivors are a prefix of each row: drop the columns no row keeps, so the noise
        # below is drawn for the nucleus, not the vocabulary.
        width = int((probs > 0).sum(dim=-1).max())
        if width < probs.shape[1]:
            probs, ids = probs[:, :width], ids[:, :width]
    return _Candidates(probs, ids)


def filtered_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[B, V] normalised distribution each row samples from (greedy rows: one-hot argmax).

    Runs min-tokens and penalties (in place on `logits`) and truncation, but no draw. For tests
    and debugging; the sampler itself never scatters back to the vocabulary.
    """
    logits = apply_penalties(apply_min_tokens(logits, metadata), metadata)
    one_hot = F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    if metadata.all_greedy:
        return one_hot
    candidates = _truncate(logits, metadata)
    if candidates.token_ids is None:
        out = candidates.probs.clone()
    else:
        out = torch.zeros_like(logits).scatter_(1, candidates.token_ids, candidates.probs)
    out /= out.sum(dim=-1, keepdim=True)
    if metadata.is_greedy is not None:
        out = torch.where(metadata.is_greedy.unsqueeze(1), one_hot, out)
    return out


class Sampler:
    """Picks one token per row. Holds the generator shared by unseeded rows.

    `logits` is consumed: penalties and min-tokens masking write into it.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        # One generator per device, re-seeded for each seeded row: creating one per row per
        # step would cost more than the reseed.
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.is_plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1), [None] * metadata.num_rows)
        if logits.dtype != torch.float32:
            logits = logits.float()

        raw_logprobs = None
        if metadata.logprobs_rows is not None:
            # Before any penalty touches the logits: logprobs describe the model, not the
            # sampling policy (OpenAI and vLLM's default).
            raw_logprobs = logits.index_select(0, metadata.logprobs_rows).log_softmax(dim=-1)

        apply_min_tokens(logits, metadata)
        apply_penalties(logits, metadata)

        if metadata.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            greedy_ids = logits.argmax(dim=-1) if metadata.is_greedy is not None else None
            token_ids = self._draw(_truncate(logits, metadata), metadata)
            if greedy_ids is not None:
                assert metadata.is_greedy is not None
                token_ids = torch.where(metadata.is_greedy, greedy_ids, token_ids)

        logprobs: list[TokenLogprobs | None] = [None] * metadata.num_rows
        if raw_logprobs is not None:
            assert metadata.logprobs_rows is not None
            self._fill_logprobs(logprobs, raw_logprobs, token_ids, metadata)
        return SamplerOutput(token_ids, logprobs)

    def _draw(self, candidates: _Candidates, metadata: SamplingMetadata) -> torch.Tensor:
        """Exponential race: argmax(p / E), E ~ Exp(1) iid, picks token i with probability p_i.

        Unlike torch.multinomial, each token's noise is its own: a seeded row fills its noise
        from its own generator, indexed by vocabulary id, so its draw depends on nothing else in
        the batch and not on how truncation laid out the columns.
        """
        probs, ids = candidates.probs, candidates.token_ids
        device = probs.device
        noise = torch.empty_like(probs)
        _exponential_(noise, self._generator(device))
        if metadata.seeded_rows:
            # One uniform per vocabulary token per seeded row (that is what makes the draw
            # independent of the layout), but the log only for the candidates.
            row_generator = self._row_generator(device)
            row_uniform = torch.empty(metadata.vocab_size, dtype=probs.dtype, device=device)
            for row, seed in zip(metadata.seeded_rows, metadata.row_seeds, strict=True):
                row_generator.manual_seed(seed)
                row_uniform.uniform_(generator=row_generator)
                picked = row_uniform if ids is None else row_uniform[ids[row]]
                noise[row] = picked.log().neg_()
        choice = (probs / noise).argmax(dim=-1)
        if ids is None:
            return choice
        return ids.gather(1, choice.unsqueeze(1)).squeeze(1)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator

    def _row_generator(self, device: torch.device) -> torch.Generator:
        generator = self._row_generators.get(device)
        if generator is None:
            generator = self._row_generators[device] = torch.Generator(device=device)
        return generator

    @staticmethod
    def _fill_logprobs(
        out: list[TokenLogprobs | None],
        raw_logprobs: torch.Tensor,
        token_ids: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> None:
        rows = metadata.logprobs_rows
        assert rows is not None
        sampled = raw_logprobs.gather(1, token_ids.index_select(0, rows).unsqueeze(1))
        top_logprobs, top_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)
        # One device->host copy per tensor, then plain Python.
        for row, token_logprob, ids, values in zip(
            rows.tolist(),
            sampled.squeeze(1).tolist(),
            top_ids.tolist(),
            top_logprobs.tolist(),
            strict=True,
        ):
            n = metadata.num_logprobs[row]
            out[row] = TokenLogprobs(token_logprob, ids[:n], values[:n])


def _exponential_(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill with Exp(1) as -log(U), U ~ U[0, 1) (the seeded rows in `_draw` do the same).

    On CPU this is ~6x faster than Tensor.exponential_ (measured at V=49152). U = 0 gives
    E = inf and p / E = 0: the token loses, never a NaN; E is never 0 since U < 1.
    """
    return out.uniform_(generator=generator).log_().neg_()
