"""How many draft tokens each sequence may verify in a step: as many as pay for themselves.

A draft token that is verified costs one more token of forward work; it pays when it is
accepted. At one user a decode step is bound by reading the weights, so a few more tokens cost
almost nothing and every accepted draft is nearly free; in a large batch the step is bound by
arithmetic, each extra token costs its full share, and drafts lose. The policy decides from two
things it measures (pure: times are passed in, nothing is read from a clock):

    step cost      seconds = fixed + per_row * rows, a least-squares line over recent
                   decode steps (decayed, so it follows the machine; a row is a decode or a
                   draft), and the cost of a prefill token above that line, kept apart: a
                   prompt token goes through large tiles and attends causally, so it costs
                   a fraction of a decode row, and steps with prefill chunks on the line
                   would flatten it and price drafts below their cost (measured: 4 users on
                   2 Intel cores lost 4-10 % of output tok/s to drafts that way)
    acceptance     for each sequence, the share of its proposed drafts accepted (decayed),
                   starting from the batch-wide share

With a step expected to yield N output tokens in D seconds, one more draft whose chance of
being accepted is v raises the output tokens per second iff v > per_row * N / D. Draft j of
a sequence is accepted only if drafts 1..j-1 were (chance alpha^j), so each sequence's
candidates come in decreasing value; the policy takes the most valuable candidates of the whole
batch while they pay, and stops at the first that does not. (A step that is long anyway, with a
prefill chunk in it, makes a draft relatively cheaper, so such steps draft more.)

Backing off and probing: a draft worth less than MIN_DRAFT_VALUE is never granted (the line
does not see the host's work per draft: proposing, a sampler row, verifying), so a sequence
whose drafts keep failing stops drafting within two or three steps. Its acceptance is then
frozen (nothing new is verified), so every PROBE_INTERVAL of its decodes it is granted one
draft anyway, where the step is not compute-bound: an answer that starts quoting its context
is noticed, at the price of one row in PROBE_INTERVAL steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Until the cost line has seen steps of different sizes, assume a memory-bound step whose extra
# token costs this share of the fixed part (a 135M model on 2 CPU cores: ~2 %).
PRIOR_TOKEN_SHARE = 0.02
# Before any draft of a sequence was verified: the batch-wide share, or this before any at all.
PRIOR_ACCEPTANCE = 0.5
# Least chance of acceptance a granted draft may have: below it the draft's host-side work
# (proposal, sampler row, verification: ~0.1 ms) outweighs what it saves.
MIN_DRAFT_VALUE = 0.05
# A sequence not granted drafts for this many of its decodes gets one draft to re-measure.
PROBE_INTERVAL = 16
# Weight kept by old observations at each new one (about the last 50 steps / 20 verifications).
STEP_DECAY = 0.98
ACCEPTANCE_DECAY = 0.95


@dataclass(slots=True)
class StepCostModel:
    """seconds = fixed + per_token * tokens, fitted by exponentially weighted least squares."""

    decay: float = STEP_DECAY
    _weight: float = 0.0
    _sum_x: float = 0.0
    _sum_y: float = 0.0
    _sum_xx: float = 0.0
    _sum_xy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(num_tokens), seconds
        self._weight = d * self._weight + 1.0
        self._sum_x = d * self._sum_x + x
        self._sum_y = d * self._sum_y + y
        self._sum_xx = d * self._sum_xx + x * x
        self._sum_xy = d * self._sum_xy + x * y

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any step. While every step seen
        had about the same size the slope is unknown, and the prior share stands in."""
        if self._weight == 0.0:
            return None
        mean_x, mean_y = self._sum_x / self._weight, self._sum_y / self._weight
        variance = self._sum_xx / self._weight - mean_x * mean_x
        if variance < 1.0:  # sizes spread by less than a token: no slope to read
            fixed = mean_y / (1.0 + PRIOR_TOKEN_SHARE * mean_x)
            return fixed, PRIOR_TOKEN_SHARE * fixed
        slope = (self._sum_xy / self._weight - mean_x * mean_y) / variance
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope


@dataclass(slots=True)
class PrefillCost:
    """Seconds per prefill token beyond the decode line, a decayed mean over steps with
    prefill chunks."""

    decay: float = STEP_DECAY
    _tokens: float = 0.0
    _seconds: float = 0.0

    def observe(self, num_tokens: int, extra_seconds: float) -> None:
        self._tokens = self.decay * self._tokens + num_tokens
        self._seconds = self.decay * self._seconds + max(extra_seconds, 0.0)

    def per_token(self, fallback: float) -> float:
        """The mean, or `fallback` before any prefill step was seen."""
        return self._seconds / self._tokens if self._tokens > 0.0 else fallback


@dataclass(slots=True)
class _Acceptance:
    proposed: float = 0.0
    accepted: float = 0.0

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        self.proposed = decay * self.proposed + proposed
        self.accepted = decay * self.accepted + accepted

    def rate(self, prior: float) -> float:
        # One proposal's worth of the prior keeps a first miss from ruling a sequence out.
        return (self.accepted + prior) / (self.proposed + 1.0)


@dataclass(slots=True)
class SpeculationPolicy:
    """Draft slots per sequence for the next step, from measured step costs and acceptance."""

    max_draft_tokens: int
    cost: StepCostModel = field(default_factory=StepCostModel)
    """Decode steps: seconds = fixed + per_row * rows (decodes and drafts)."""
    prefill_cost: PrefillCost = field(default_factory=PrefillCost)
    _first_steps: StepCostModel = field(default_factory=StepCostModel)
    """Every step, prefill too, until a decode step is measured: the first decodes' line (a
    request's first decode follows its prefill)."""
    _batch: _Acceptance = field(default_factory=_Acceptance)
    _sequences: dict[str, _Acceptance] = field(default_factory=dict)
    _idle_decodes: dict[str, int] = field(default_factory=dict)
    """Decodes since a sequence was last granted a draft (no entry: none yet)."""

    def observe_step(self, num_rows: int, seconds: float, num_prefill_tokens: int = 0) -> None:
        """A step computed `num_rows` decode and draft rows and `num_prefill_tokens` prompt
        tokens in `seconds`. Decode steps fit the line; a step with prefill tells what its
        prompt tokens cost above the line (once the line exists)."""
        if num_prefill_tokens <= 0:
            self.cost.observe(num_rows, seconds)
            return
        line = self.cost.line()
        if line is None:
            self._first_steps.observe(num_rows + num_prefill_tokens, seconds)
        else:
            fixed, per_row = line
            self.prefill_cost.observe(num_prefill_tokens, seconds - fixed - per_row * num_rows)

    def _step_seconds(self, num_rows: int, other_tokens: int) -> tuple[float, float] | None:
        """(seconds a step of `num_rows` rows and `other_tokens` of prefill is expected to
        take, seconds per more row), or None before any step was measured."""
        line = self.cost.line() or self._first_steps.line()
        if line is None:
            return None
        fixed, per_row = line
        prefill = self.prefill_cost.per_token(per_row) * other_tokens
        return fixed + per_row * num_rows + prefill, per_row

    def observe_drafts(self, request_id: str, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` drafts a sequence verified were accepted."""
        if proposed <= 0:
            return
        self._batch.observe(proposed, accepted, ACCEPTANCE_DECAY)
        sequence = self._sequences.setdefault(request_id, _Acceptance())
        sequence.observe(proposed, accepted, ACCEPTANCE_DECAY)

    def forget(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)
        self._idle_decodes.pop(request_id, None)

    def acceptance(self, request_id: str) -> float:
        prior = self._batch.rate(PRIOR_ACCEPTANCE) if self._batch.proposed else PRIOR_ACCEPTANCE
        sequence = self._sequences.get(request_id)
        return prior if sequence is None else sequence.rate(prior)

    def draft_slots(
        self,
        decoding: Sequence[str],
        other_tokens: int = 0,
        caps: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Slots for the decoding sequences of the next step (each also computes its one
        regular token), given `other_tokens` of prefill in the same step; `caps` bounds a
        sequence's slots below max_draft_tokens (its request's own limit, its room left).
        Sequences that should not speculate are left out."""
        if self.max_draft_tokens <= 0 or not decoding:
            return {}
        estimate = self._step_seconds(len(decoding), other_tokens)
        if estimate is None:
            return {}
        # Output tokens the step is expected to yield, and what it costs.
        expected = float(len(decoding))
        seconds, per_token = estimate
        # Candidates by value, best first: (-alpha^j, request index, j).
        rates = [self.acceptance(request_id) for request_id in decoding]
        limits = [
            self.max_draft_tokens if caps is None else min(self.max_draft_tokens, caps[rid])
            for rid in decoding
        ]
        heap = [
            (-rate, index, 1)
            for index, rate in enumerate(rates)
            if rate > 0.0 and limits[index] > 0
        ]
        heapq.heapify(heap)
        slots: dict[str, int] = {}
        while heap:
            negative_value, index, depth = heapq.heappop(heap)
            value = -negative_value
            if not _pays(value, expected, seconds, per_token):
                break  # the best remaining candidate does not pay; no later one can
            slots[decoding[index]] = depth
            expected += value
            seconds += per_token
            if depth < limits[index]:
                heapq.heappush(heap, (-(value * rates[index]), index, depth + 1))
        for index, request_id in enumerate(decoding):
            if request_id in slots:
                self._idle_decodes[request_id] = 0
                continue
            idle = self._idle_decodes.get(request_id, 0) + 1
            if (
                idle >= PROBE_INTERVAL
                and limits[index] > 0
                and _pays(PRIOR_ACCEPTANCE, expected, seconds, per_token)
            ):
                slots[request_id], idle = 1, 0
                expected += rates[index]
                seconds += per_token
            self._idle_decodes[request_id] = idle
        return slots

    def is_compute_bound(self, num_decoding: int, other_tokens: int = 0) -> bool:
        """Whether the next step (`num_decoding` decodes, `other_tokens` of prefill) is too
        costly per token for even a draft as likely as the prior to pay: where no drafts are
        granted because of the step, not the sequences (also before any step is measured)."""
        estimate = self._step_seconds(num_decoding, other_tokens)
        if estimate is None:
            return True
        seconds, per_token = estimate
        return not _pays(PRIOR_ACCEPTANCE, float(num_decoding), seconds, per_token)


def _pays(value: float, expected: float, seconds: float, per_token: float) -> bool:
    """Whether a draft accepted with chance `value` raises the output rate of a step expected
    to yield `expected` tokens in `seconds`, where one more token costs `per_token`."""
    return seconds > 0.0 and value >= MIN_DRAFT_VALUE and value > per_token * expected / seconds
