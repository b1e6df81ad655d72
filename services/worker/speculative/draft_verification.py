"""Verify one sequence's draft tokens against the model's distributions at their positions, so
that the tokens emitted follow exactly the distribution plain decoding would sample from.

A step that verifies d drafts x_1..x_d computes d + 1 rows of probabilities: p_0 at the
sequence's last token (what it would sample next), p_j after draft j. Drafts from prompt lookup
are certain guesses (a point mass on x_j), so speculative sampling's rule becomes:

    for j = 1..d:   accept x_j with probability p_{j-1}(x_j)
                    else emit a token drawn from p_{j-1} with x_j removed, renormalised; stop
    all accepted:   emit a bonus token drawn from p_d

Position j-1 then emits x_j with probability p(x_j) and any other token y with probability
(1 - p(x_j)) * p(y) / (1 - p(x_j)) = p(y): the plain distribution, whatever the drafts were.
Greedy rows (one-hot p) accept a draft exactly when it is the argmax, and emit the argmax on
the first miss: the greedy output is unchanged.

`probs` rows are the sampler's final distributions (after penalties, bias, grammar mask,
temperature and truncation), so every sampling option keeps its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verified:
    token_ids: list[int]
    """The tokens to append: the accepted drafts, then one token drawn by the rule above."""
    num_accepted: int


def verify_greedy(argmax_ids: list[int], draft_ids: list[int]) -> Verified:
    """`argmax_ids`: the argmax at each of the d + 1 rows."""
    _check(len(argmax_ids), draft_ids)
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == argmax_ids[accepted]:
        accepted += 1
    return Verified([*draft_ids[:accepted], argmax_ids[accepted]], accepted)


def verify_sampled(
    probs: torch.Tensor, draft_ids: list[int], generator: torch.Generator | None = None
) -> Verified:
    """`probs` [d + 1, V]: the distribution at each row (rows sum to 1)."""
    _check(probs.shape[0], draft_ids)
    # One uniform per draft, drawn up front: the count drawn does not depend on the outcome,
    # so a seeded sequence's generator advances alike whatever is accepted.
    uniforms = torch.rand(len(draft_ids), generator=generator, dtype=torch.float64).tolist()
    for j, draft in enumerate(draft_ids):
        chance = float(probs[j, draft])
        if uniforms[j] < chance:
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        if float(residual.sum()) <= 0.0:  # p was a point mass on the draft: cannot miss
            continue
        token = int(torch.multinomial(residual, 1, generator=generator))
        return Verified([*draft_ids[:j], token], j)
    bonus = int(torch.multinomial(probs[len(draft_ids)], 1, generator=generator))
    return Verified([*draft_ids, bonus], len(draft_ids))


def _check(num_rows: int, draft_ids: list[int]) -> None:
    if num_rows != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} rows, got {num_rows}")
