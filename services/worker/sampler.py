"""The worker's sampler: one next token per batch row from the model's last-position logits.

Per step the runner turns its persistent batch into `SamplerRow`s, calls
`build_sampling_metadata` (plain Python in, tensors out) and then `Sampler()(logits, metadata)`.
The order of operations, per row, is the one vLLM and Hugging Face users expect:

    raw logits ──► structured output: tokens the row's grammar disallows -> -inf
        ──► logprobs (log_softmax of these logits, if asked)
        │
        ├─ min_new_tokens: EOS and stop ids -> -inf while the output is too short
        ├─ penalties: repetition (prompt + output), presence, frequency (output)
        ├─ logit_bias: + bias on the listed tokens; allowed_token_ids: the others -> -inf
        ├─ greedy rows: argmax                                     ─┐
        └─ other rows: / temperature -> top-k -> top-p -> min-p     ├─► token_ids [B]
                       -> exponential race argmax(p / E), E ~ Exp(1)┘

Every per-row parameter is a [B] tensor, so a batch mixing greedy, top-k, top-p and min-p rows
costs a handful of batched ops, not a Python loop over rows. The only per-row loops are over
rows with a `seed` (each draws its noise from its own generator) and the final conversion of
logprobs to Python lists.

The metadata (sampling_metadata.py) holds tensors plus the few Python flags the sampler
branches on; everything is built from scratch each step (see `build_sampling_metadata`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import ops
from services.contracts.step import TokenLogprobs
from services.worker.sampling_metadata import SamplingMetadata

# Top-p without top-k needs the tokens in probability order. A full sort of V=49152 costs
# ~0.5 s for 256 rows on a 2-core CPU, ~8x a topk(256), while real next-token distributions
# put the nucleus in the first few dozen tokens. So try topk with these sizes first and sort
# the whole vocabulary only when some row's nucleus does not fit in them.
TOP_P_PROBE_SIZES = (256, 2048)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[B] int64 on the logits' device."""
    logprobs: list[TokenLogprobs | None]
    """Per row; None where the row's sampling.logprobs is 0."""


def apply_grammar_mask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set the logits of tokens a row's grammar disallows to -inf, in place, on the
    constrained rows only (ours in C++ on the CPU, xgrammar's Triton kernel on CUDA)."""
    mask = metadata.grammar_mask
    if mask is None:
        return logits
    bitmask = mask.bitmask
    if ops.apply_token_bitmask(logits, bitmask, mask.rows, metadata.vocab_size):
        return logits  # our C++ kernel on the CPU (kernels/csrc/token_bitmask.cpp)
    import xgrammar as xgr

    if bitmask.device != logits.device:
        bitmask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=metadata.vocab_size, indices=mask.rows
    )
    return logits


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


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logit_bias added, then every token outside a row's allowed_token_ids set to -inf, in
    place. After the penalties and before temperature, as OpenAI and vLLM order them; the mask
    comes last so that no bias can bring a disallowed token back."""
    if metadata.logit_bias_index is None and metadata.allowed_rows is None:
        return logits
    if not logits.is_contiguous():
        raise ValueError("apply_logit_bias needs contiguous logits (it indexes logits.view(-1))")
    flat = logits.view(-1)
    if metadata.logit_bias_index is not None:
        assert metadata.logit_bias is not None
        flat.index_add_(0, metadata.logit_bias_index, metadata.logit_bias)
    if metadata.allowed_rows is not None:
        assert metadata.allowed_index is not None
        # Keep the allowed logits aside, blank the rows, put them back: O(allowed) indices
        # rather than a [rows, V] mask built per step.
        kept = flat[metadata.allowed_index]
        logits[metadata.allowed_rows] = -math.inf
        flat[metadata.allowed_index] = kept
    return logits


def apply_sampling_policy(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """What the request's parameters do to the logits before temperature, in order, in place:
    min-tokens masking, penalties, logit_bias and allowed_token_ids. One chain for the sampler
    and for filtered_probs, so the distribution the tests read is the one drawn from."""
    apply_min_tokens(logits, metadata)
    apply_penalties(logits, metadata)
    return apply_logit_bias(logits, metadata)


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

    Runs the grammar mask, apply_sampling_policy (in place on `logits`) and truncation, but
    no draw. For tests
    and debugging; the sampler itself never scatters back to the vocabulary.
    """
    apply_grammar_mask(logits, metadata)
    logits = apply_sampling_policy(logits, metadata)
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

    `logits` is consumed: the grammar mask and apply_sampling_policy write into it.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        # One generator per device, re-seeded for each seeded row: creating one per row per
        # step would cost more than the reseed.
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # First: a grammar decides which tokens exist at all, so logprobs describe the
        # distribution the token is drawn from (as vLLM's do with structured output).
        apply_grammar_mask(logits, metadata)
        if metadata.is_plain_greedy:
            return SamplerOutput(ops.argmax_rows(logits), [None] * metadata.num_rows)
        if logits.dtype != torch.float32:
            logits = logits.float()

        raw_logprobs = None
        if metadata.logprobs_rows is not None:
            # Before any penalty touches the logits: logprobs describe the model, not the
            # sampling policy (OpenAI and vLLM's default).
            raw_logprobs = logits.index_select(0, metadata.logprobs_rows).log_softmax(dim=-1)

        apply_sampling_policy(logits, metadata)

        if metadata.all_greedy:
            token_ids = ops.argmax_rows(logits)
        else:
            greedy_ids = ops.argmax_rows(logits) if metadata.is_greedy is not None else None
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

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from (also draft verification's)."""
        return self._generator(device)

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
