"""Grammar matching on the worker: one xgrammar matcher per constrained sequence of the
persistent batch, a token bitmask per step, and the sampled tokens fed back.

Per step, for the rows that sample (in logits order):

    fill:   batch_fill_next_token_bitmask(matchers of constrained rows) -> bitmask[rows]
    apply:  the sampler sets logits of disallowed tokens to -inf on those rows only
    accept: each matcher accepts its row's sampled token

The matchers live here, beside the sampler, because the worker is where the tokens are
sampled: the scheduler stays pure Python and never waits for a mask, and with overlapped
scheduling the worker appends its own sampled token before the scheduler hears of it, so
only the worker knows a sequence's latest token in time to mask the next step.

A grammar with `starts_after` (a reasoning model's `</think>`) waits behind a gate: the
sequence samples freely, its tokens go to the gate, and the matcher takes over from the token
after the gate's ids have all come out, in a row.

Speculation: a draft is cut where the grammar refuses it (cut_drafts: the matcher accepts the
draft's tokens, then rolls back), so every draft token is one the grammar allows; a step that
verifies d drafts fills d + 1 rows for the sequence, row j with the mask after drafts 1..j
(the matcher steps through the drafts and rolls back), and the accepted drafts then the sampled
token are fed back in order. A gated sequence drafts up to, not including, the token that
would open its gate (its rows all stay unmasked).

A sequence that comes back after a preemption (a NewSequence with output tokens) gets a new
matcher that replays its output. Once the output is complete the grammar allows only the stop
tokens (the model's EOS); the matcher terminates on it, and a step the scheduler planned
before it heard of that EOS samples unconstrained (its token is discarded).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from services.common.grammar import GrammarCompiler
from services.contracts.step import BatchPlan
from services.contracts.structured_output import StructuredOutput
from services.worker.sampling_metadata import GrammarMask

log = logging.getLogger(__name__)


class GrammarMatchers:
    """The batch's matchers, by request id, and the one bitmask tensor every step reuses."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._matchers: dict[str, Any] = {}
        self._gates: dict[str, GrammarGate] = {}
        """Sequences whose grammar has not started yet (a subset of the matchers' ids)."""
        self._bitmask: torch.Tensor | None = None
        """[rows, ceil(V / 32)] int32 on the CPU (where xgrammar fills it); grown, never
        shrunk, so a step allocates nothing."""
        self._batch_matcher: Any = None

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def clear(self) -> None:
        self._matchers.clear()
        self._gates.clear()

    def apply(self, plan: BatchPlan) -> None:
        """Drop the matchers of dropped sequences, build those of new ones (finished ids first,
        as the batch applies them: a preempted id may come back in the same plan)."""
        if self._matchers:
            for request_id in plan.finished_request_ids:
                self._matchers.pop(request_id, None)
                self._gates.pop(request_id, None)
        for seq in plan.new_sequences:
            spec = seq.sampling.structured_output
            if spec is not None:
                self.add(seq.request_id, spec, seq.token_ids[seq.num_prompt_tokens :])

    def add(self, request_id: str, spec: StructuredOutput, output_token_ids: Sequence[int]) -> None:
        """A matcher for a sequence, its output so far replayed (a resumed sequence).

        The grammar is normally compiled already (the scheduler asked for it with
        PrepareGrammar before admitting the request); if the worker lost it (restarted, or
        evicted it from the cache), it compiles here, on the step.
        """
        import xgrammar as xgr

        try:
            compiled = self.compiler.compile(spec)
        except ValueError as exc:
            # The tokenizer tier and PrepareGrammar refuse such a spec before it gets here.
            log.error(
                "grammar does not compile; sequence unconstrained",
                extra={"request_id": request_id, "error": str(exc)},
            )
            return
        matcher = xgr.GrammarMatcher(compiled)
        self._matchers[request_id] = matcher
        self._gates.pop(request_id, None)
        if spec.starts_after:
            gate = GrammarGate(spec.starts_after)
            passed = gate.feed_all(output_token_ids)
            if passed is None:
                self._gates[request_id] = gate
                return
            output_token_ids = output_token_ids[passed:]
        for position, token_id in enumerate(output_token_ids):
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                log.warning(
                    "replayed token refused by the grammar",
                    extra={"request_id": request_id, "position": position, "token": token_id},
                )
                break

    def cut_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """`drafts` with each constrained sequence's draft cut before the first token its
        grammar refuses (and after one that completes it); sequences left without a draft
        are dropped. The matchers end as they started."""
        if not self._matchers:
            return drafts
        kept: dict[str, list[int]] = {}
        for request_id, draft in drafts.items():
            matcher = self._matchers.get(request_id)
            if matcher is None:
                kept[request_id] = draft
                continue
            gate = self._gates.get(request_id)
            if gate is not None:
                draft = draft[: gate.tokens_before_opening(draft)]
            elif matcher.is_terminated():
                draft = []
            else:
                num_allowed = 0
                for token_id in draft:
                    if matcher.is_terminated() or not matcher.accept_token(token_id):
                        break
                    num_allowed += 1
                if num_allowed:
                    matcher.rollback(num_allowed)
                draft = draft[:num_allowed]
            if draft:
                kept[request_id] = draft
        return kept

    def fill(
        self, sampled_request_ids: Sequence[str], drafts: dict[str, list[int]] | None = None
    ) -> GrammarMask | None:
        """The bitmask of this step's constrained rows, in logits order: each sequence's row,
        then one more per draft (cut_drafts made every draft one its grammar allows); None
        when no row is constrained, so an unconstrained batch pays one dict check."""
        if not self._matchers:
            return None
        drafts = drafts or {}
        rows: list[int] = []
        matchers: list[Any] = []
        drafting: list[tuple[Any, int, list[int]]] = []  # (matcher, first row, draft)
        row = 0
        for request_id in sampled_request_ids:
            draft = drafts.get(request_id, [])
            matcher = self._matchers.get(request_id)
            if (
                matcher is not None
                and not matcher.is_terminated()
                and request_id not in self._gates
            ):
                rows.append(row)
                matchers.append(matcher)
                if draft:
                    drafting.append((matcher, row, draft))
            row += 1 + len(draft)
        if not rows:
            return None
        bitmask = self._bitmask_for(row)
        # One call for every first row: xgrammar walks the matchers in C++ (its own threads
        # when the batch is large), instead of a Python call per row.
        self._batch().batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for matcher, first_row, draft in drafting:
            num_accepted = 0
            for offset, token_id in enumerate(draft, start=1):
                if not matcher.accept_token(token_id):
                    break
                num_accepted += 1
                if matcher.is_terminated():
                    break  # the rows after a completing token stay unmasked (discarded)
                matcher.fill_next_token_bitmask(bitmask, first_row + offset)
                rows.append(first_row + offset)
            if num_accepted:
                matcher.rollback(num_accepted)
        return GrammarMask(bitmask, sorted(rows))

    def accept(
        self, sampled: dict[str, int], accepted_drafts: dict[str, list[int]] | None = None
    ) -> None:
        """Advance each constrained sequence's matcher by its accepted drafts, then its
        sampled token."""
        if not self._matchers:
            return
        matchers: list[Any] = []
        tokens: list[int] = []
        ids: list[str] = []
        for request_id, token_id in sampled.items():
            if request_id not in self._matchers:
                continue
            drafted = accepted_drafts.get(request_id) if accepted_drafts else None
            if drafted:
                # Drafts go one by one (rare: only speculating constrained sequences).
                for draft_id in drafted:
                    self._accept_one(request_id, draft_id)
                self._accept_one(request_id, token_id)
                continue
            gate = self._gates.get(request_id)
            if gate is not None:
                if gate.feed(token_id):
                    del self._gates[request_id]  # the grammar starts at the next token
                continue
            matcher = self._matchers[request_id]
            if not matcher.is_terminated():
                matchers.append(matcher)
                tokens.append(token_id)
                ids.append(request_id)
        if not matchers:
            return
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        for request_id, token_id, ok in zip(ids, tokens, accepted, strict=True):
            if not ok:
                _refused(request_id, token_id)

    def _accept_one(self, request_id: str, token_id: int) -> None:
        gate = self._gates.get(request_id)
        if gate is not None:
            if gate.feed(token_id):
                del self._gates[request_id]
            return
        matcher = self._matchers[request_id]
        if not matcher.is_terminated() and not matcher.accept_token(token_id):
            _refused(request_id, token_id)

    def is_terminated(self, request_id: str) -> bool:
        matcher = self._matchers.get(request_id)
        return matcher is not None and bool(matcher.is_terminated())

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            capacity = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]))
            self._bitmask = xgr.allocate_token_bitmask(capacity, self.vocab_size)
        return self._bitmask

    def _batch(self) -> Any:
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher()
        return self._batch_matcher


def _refused(request_id: str, token_id: int) -> None:
    # Cannot happen for a masked row; logged rather than raised: the step's other sequences
    # must go on.
    log.warning(
        "sampled token refused by the grammar", extra={"request_id": request_id, "token": token_id}
    )


class GrammarGate:
    """Waits for `ids` to come out in a row; `feed` says when they have."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = tuple(ids)
        self._recent: list[int] = []

    def feed(self, token_id: int) -> bool:
        self._recent.append(token_id)
        del self._recent[: -len(self.ids)]
        return tuple(self._recent) == self.ids

    def tokens_before_opening(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` could come before the one that opens the gate (all of
        them if none does), the gate left as it was."""
        recent = list(self._recent)
        for count, token_id in enumerate(token_ids):
            recent.append(token_id)
            del recent[: -len(self.ids)]
            if tuple(recent) == self.ids:
                return count
        return len(token_ids)

    def feed_all(self, token_ids: Sequence[int]) -> int | None:
        """How many of `token_ids` it took to open (None: still closed after all of them)."""
        for count, token_id in enumerate(token_ids, start=1):
            if self.feed(token_id):
                return count
        return None
