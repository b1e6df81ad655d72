"""The worker's persistent batch: every sequence it holds, updated by plan deltas, and turned
into the tensors of one forward step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan
from services.worker.forward_batch import ForwardBatch
from services.worker.sampling_metadata import SamplerRow
from services.worker.speculative.ngram_proposer import NgramIndex
from services.worker.speculative.suffix_cache import SuffixCache


@dataclass(slots=True)
class CachedSequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    ngrams: NgramIndex | None = None
    """Prompt-lookup index of token_ids, built the first time the sequence may speculate."""
    scope: tuple[bytes, str] = (b"", "")
    """(cache salt, LoRA adapter): the text suffix decoding may draft this sequence from."""

    def sampler_row(self, eos_token_ids: tuple[int, ...], drafts: Sequence[int] = ()) -> SamplerRow:
        """The sampling inputs at the sequence's end, or after `drafts` (a verification row:
        penalties and min_new_tokens count the drafts before it as output)."""
        # The prompt is only read by penalties; skip copying a long prompt every step.
        prompt = self.token_ids[: self.num_prompt_tokens] if self.sampling.has_penalties else ()
        output = self.token_ids[self.num_prompt_tokens :]
        if drafts:
            output.extend(drafts)
        return SamplerRow(
            sampling=self.sampling,
            prompt_token_ids=prompt,
            output_token_ids=output,
            eos_token_ids=eos_token_ids,
        )


@dataclass(slots=True)
class StepInputs:
    forward: ForwardBatch
    sampled_request_ids: list[str]
    """Request ids whose scheduled range reaches their last token, in the order of
    forward.logits_indices: one row of logits each, then one more per draft."""
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens each speculating sequence verifies this step (its rows follow its first)."""
    sequences: list[CachedSequence] = field(default_factory=list)
    """Every scheduled sequence in token order (prefills, then decodes)."""
    row_counts: list[int] = field(default_factory=list)
    """Rows of each of `sequences` (tokens, drafts included): with them, a per-sequence
    table over the rows (LoRA segments) is built."""


class InputBatch:
    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        *,
        per_token_attention: bool = False,
        ngram_sizes: tuple[int, int] = (2, 4),
        suffix_cache: SuffixCache | None = None,
        sampled_drafts: bool = True,
    ) -> None:
        self.block_size = block_size
        self.sampled_drafts = sampled_drafts
        """Whether sampled (not greedy) sequences may draft. Not on a worker with a --seed:
        verification draws from its seeded generator as many times as there are drafts, and
        the drafts granted follow measured step times, so the same request on the same
        config would not repeat its sample (a request's own seed already keeps it from
        drafting: SamplingParams.can_speculate)."""
        self.ngram_sizes = ngram_sizes
        """(min n, max n) of the suffixes prompt lookup matches."""
        self.suffix_cache = suffix_cache
        """Suffix decoding's store of recent prompts and outputs (None: prompt lookup alone).
        It outlives the batch: finished sequences stay in it until the budget evicts them."""
        self.device = torch.device(device)
        self.per_token_attention = per_token_attention
        """Give every token its own block table row and context length (batch-invariant
        mode: each token attends as a decode query does)."""
        self.sequences: dict[str, CachedSequence] = {}

    def apply(self, plan: BatchPlan) -> None:
        """Bring the persistent batch up to date with a plan's deltas."""
        for request_id in plan.finished_request_ids:
            self.sequences.pop(request_id, None)
        for request_id, num_kept in plan.block_truncations.items():
            del self.sequences[request_id].block_ids[num_kept:]
        for new in plan.new_sequences:
            self.sequences[new.request_id] = CachedSequence(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                scope=(new.cache_salt, new.lora_name),
            )
            if self.suffix_cache is not None:
                self.suffix_cache.add(
                    new.request_id, (new.cache_salt, new.lora_name), new.token_ids
                )
        for delta in plan.block_deltas:
            self.sequences[delta.request_id].block_ids.extend(delta.new_block_ids)

    def propose_drafts(self, plan: BatchPlan) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Draft tokens for the decoding sequences the plan gave slots (up to their slots; a
        sequence whose context offers no guess gets none): by prompt lookup in the sequence's
        own tokens and, with a suffix cache, from the recent text of its scope; the longer
        draft wins (a tie goes to the sequence's own context). Also which proposer made each
        draft ("ngram" or "suffix")."""
        drafts: dict[str, list[int]] = {}
        proposers: dict[str, str] = {}
        for request_id, num_slots in plan.draft_slots.items():
            seq = self.sequences.get(request_id)
            if (
                seq is None
                or num_slots <= 0
                or plan.num_scheduled_tokens.get(request_id) != 1
                or seq.num_computed_tokens + 1 != len(seq.token_ids)
                or not seq.sampling.can_speculate
                or not (self.sampled_drafts or seq.sampling.is_greedy)
            ):
                continue
            if seq.ngrams is None:
                seq.ngrams = NgramIndex(*self.ngram_sizes, seq.token_ids)
            proposed, proposer = seq.ngrams.propose(num_slots), "ngram"
            if self.suffix_cache is not None and len(proposed) < num_slots:
                suffix = self.suffix_cache.propose(seq.scope, seq.token_ids, num_slots)
                if len(suffix) > len(proposed):
                    proposed, proposer = suffix, "suffix"
            if proposed:
                drafts[request_id] = proposed
                proposers[request_id] = proposer
        return drafts, proposers

    def prepare(self, plan: BatchPlan, drafts: dict[str, list[int]] | None = None) -> StepInputs:
        """Tensors for the scheduled tokens: prefill sequences first, then decodes. A decode's
        drafts follow it as decode rows of the same sequence (positions one on, the same
        block table, a context one longer each), so every decode path verifies them: each
        layer writes all rows' KV before any row attends."""
        drafts = drafts or {}
        prefills: list[tuple[CachedSequence, int]] = []
        decodes: list[CachedSequence] = []
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            seq = self.sequences[request_id]
            # A decode computes a sequence's last token. A one-token chunk that stops short
            # of the end (a prefix-cache hit, then a step budget with one token left) is a
            # prefill chunk: it must not sample.
            if num_tokens == 1 and seq.num_computed_tokens + 1 == len(seq.token_ids):
                decodes.append(seq)
            else:
                prefills.append((seq, num_tokens))

        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        logits_rows: list[int] = []
        sampled_request_ids: list[str] = []
        cu_seqlens = [0]
        prefix_lens: list[int] = []
        for seq, num_tokens in prefills:
            start = seq.num_computed_tokens
            end = start + num_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.append(np.arange(start, end, dtype=np.int64))
            cu_seqlens.append(cu_seqlens[-1] + num_tokens)
            prefix_lens.append(start)
            if end == len(seq.token_ids):
                logits_rows.append(cu_seqlens[-1] - 1)
                sampled_request_ids.append(seq.request_id)
        num_prefill_tokens = cu_seqlens[-1]

        if drafts:
            decode_counts = [1 + len(drafts.get(seq.request_id, ())) for seq in decodes]
            decode_positions = np.concatenate(
                [
                    np.arange(seq.num_computed_tokens, seq.num_computed_tokens + count)
                    for seq, count in zip(decodes, decode_counts, strict=True)
                ]
                or [np.zeros(0, np.int64)]
            ).astype(np.int64)
            for seq in decodes:
                input_ids.append(seq.token_ids[seq.num_computed_tokens])
                input_ids.extend(drafts.get(seq.request_id, ()))
                sampled_request_ids.append(seq.request_id)
        else:
            decode_counts = [1] * len(decodes)
            decode_positions = np.fromiter(
                (seq.num_computed_tokens for seq in decodes), dtype=np.int64, count=len(decodes)
            )
            for seq in decodes:
                input_ids.append(seq.token_ids[seq.num_computed_tokens])
                sampled_request_ids.append(seq.request_id)
        logits_rows.extend(range(num_prefill_tokens, num_prefill_tokens + len(decode_positions)))
        positions.append(decode_positions)

        all_positions = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        seqs = [seq for seq, _ in prefills] + decodes
        block_table = _block_table(seqs, int(all_positions.max(initial=0)) // block_size + 1)
        # Row of the block table that each token belongs to.
        counts = [n for _, n in prefills] + decode_counts
        token_rows = np.repeat(np.arange(len(seqs)), counts)
        slot_mapping = (
            block_table[token_rows, all_positions // block_size].astype(np.int64) * block_size
            + all_positions % block_size
        )
        num_prefills = len(prefills)
        forward = ForwardBatch(
            input_ids=self._tensor(np.asarray(input_ids, dtype=np.int64)),
            positions=self._tensor(all_positions),
            slot_mapping=self._tensor(slot_mapping),
            num_prefill_tokens=num_prefill_tokens,
            prefill_cu_seqlens=self._tensor(np.asarray(cu_seqlens, dtype=np.int32)),
            prefill_prefix_lens=self._tensor(np.asarray(prefix_lens, dtype=np.int32)),
            prefill_block_tables=self._tensor(block_table[:num_prefills]),
            decode_block_tables=self._tensor(
                np.repeat(block_table[num_prefills:], decode_counts, axis=0)
                if drafts
                else block_table[num_prefills:]
            ),
            decode_context_lens=self._tensor((decode_positions + 1).astype(np.int32)),
            logits_indices=self._tensor(np.asarray(logits_rows, dtype=np.int64)),
        )
        if self.per_token_attention:
            forward.token_block_tables = self._tensor(np.ascontiguousarray(block_table[token_rows]))
            forward.token_context_lens = self._tensor((all_positions + 1).astype(np.int32))
        return StepInputs(
            forward=forward,
            sampled_request_ids=sampled_request_ids,
            drafts=drafts,
            sequences=seqs,
            row_counts=counts,
        )

    def advance(
        self,
        plan: BatchPlan,
        sampled: dict[str, int],
        accepted_drafts: dict[str, list[int]] | None = None,
    ) -> None:
        """After the forward: scheduled tokens and accepted drafts are computed (a rejected
        draft's KV lies past the end, to be overwritten); accepted drafts, then the sampled
        token, join the sequence."""
        sequences = self.sequences
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            sequences[request_id].num_computed_tokens += num_tokens
        for request_id, token_id in sampled.items():
            seq = sequences[request_id]
            accepted = accepted_drafts.get(request_id) if accepted_drafts else None
            if accepted:
                seq.num_computed_tokens += len(accepted)
                seq.token_ids.extend(accepted)
            seq.token_ids.append(token_id)
            new_tokens = [*accepted, token_id] if accepted else [token_id]
            if seq.ngrams is not None:
                seq.ngrams.extend(new_tokens)
            if self.suffix_cache is not None:
                self.suffix_cache.extend(request_id, new_tokens)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def _block_table(seqs: list[CachedSequence], width: int) -> np.ndarray:
    """[len(seqs), width] int32, padded with block 0 (never read past a context length)."""
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for row, seq in enumerate(seqs):
        blocks = seq.block_ids[:width]
        table[row, : len(blocks)] = blocks
    return table
