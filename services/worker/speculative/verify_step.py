"""Sampling a step that carries drafts: one logits row per sequence plus one per draft token,
then each speculating sequence keeps the drafts the model agrees with."""

from __future__ import annotations

import torch

from services.worker.input_batch import CachedSequence, StepInputs
from services.worker.sampler import Sampler, filtered_probs
from services.worker.sampling_metadata import GrammarMask, build_sampling_metadata
from services.worker.speculative.draft_verification import verify_greedy, verify_sampled
from services.worker.structured_output.matchers import GrammarMatchers


def sample_and_verify(
    logits: torch.Tensor,
    inputs: StepInputs,
    sequences: dict[str, CachedSequence],
    sampler: Sampler,
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    grammars: GrammarMatchers | None,
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Every row is processed as its own sampling position (penalties and min_new_tokens count
    the drafts before it), then each speculating sequence keeps the drafts the model agrees
    with (draft_verification.py): greedy rows by argmax, sampled rows by the rejection rule on
    the row's final distribution. Returns (sampled token, accepted drafts) per id."""
    device = logits.device
    rows = []
    first_row: dict[str, int] = {}
    for request_id in inputs.sampled_request_ids:
        seq = sequences[request_id]
        draft = inputs.drafts.get(request_id, ())
        first_row[request_id] = len(rows)
        rows.extend(seq.sampler_row(eos_token_ids, draft[:j]) for j in range(len(draft) + 1))
    metadata = build_sampling_metadata(rows, vocab_size, device)
    if grammars is not None:
        # Each draft row is masked by the grammar's state after the drafts before it.
        metadata.grammar_mask = grammars.fill(inputs.sampled_request_ids, inputs.drafts)
    # A sampled (not greedy) speculating sequence verifies against its rows' final
    # distributions, taken before the sampler consumes the logits.
    probs: dict[str, torch.Tensor] = {}
    for request_id, draft in inputs.drafts.items():
        if not sequences[request_id].sampling.is_greedy:
            start, end = first_row[request_id], first_row[request_id] + len(draft) + 1
            own = build_sampling_metadata(rows[start:end], vocab_size, device)
            own.grammar_mask = _rows_of(metadata.grammar_mask, start, end)
            probs[request_id] = filtered_probs(logits[start:end].float().clone(), own)
    output = sampler(logits, metadata)
    token_ids = output.token_ids.tolist()
    sampled: dict[str, int] = {}
    accepted: dict[str, list[int]] = {}
    generator = sampler.generator(device)
    for request_id in inputs.sampled_request_ids:
        start = first_row[request_id]
        draft = inputs.drafts.get(request_id)
        if not draft:
            sampled[request_id] = token_ids[start]
            continue
        if request_id in probs:
            verified = verify_sampled(probs[request_id], draft, generator)
        else:
            verified = verify_greedy(token_ids[start : start + len(draft) + 1], draft)
        accepted[request_id] = verified.token_ids[:-1]
        sampled[request_id] = verified.token_ids[-1]
    return sampled, accepted


def _rows_of(mask: GrammarMask | None, start: int, end: int) -> GrammarMask | None:
    """The grammar mask of rows [start, end), renumbered from 0."""
    if mask is None:
        return None
    rows = [row - start for row in mask.rows if start <= row < end]
    return GrammarMask(mask.bitmask[start:end], rows) if rows else None
