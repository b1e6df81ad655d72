"""Requests with n > 1 choices: how their prompt is computed once and shared.

Choice 0 prefills all but the prompt's last token, then forks choices 1..n-1, which share its
block table (reference counts); each choice then computes the last prompt token itself, a
one-token step like a decode, and samples its own first token. The partial last block is
copied on the first write of each choice but the last to write it (copy-on-write,
`BatchPlan.block_copies`):

    prompt:   [ block 0 (full) | block 1 (full) | block 2: t32..t38 . | t39 ]
    choice 0: ─ prefill t0..t38 ──────────────────────────────────────▶ fork
    choice i:   block 0, 1 shared │ block 2 copied, then t39 computed, first token sampled

Needing no worker change is why: a worker samples one token per sequence per step, and here
each choice's first token comes from its own step. A forked choice is then an ordinary
sequence (preempted, it is recomputed alone); its events go out under the request's id with
its index, and the request ends when its last choice does. The scheduler core forks (a
running choice 0) or splits (a waiting one) with `new_choice`.
"""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.request import Request, choice_request_id

_INT64_MAX = 2**63 - 1


def new_choice(first: Request, index: int) -> Request:
    """Choice `index` of `first`'s request: the same prompt and limits, seed + index; added
    to the request's group."""
    group = first.group
    assert group is not None
    sampling = first.sampling
    if sampling.seed is not None:
        # vLLM's rule, so each choice is reproducible alone; wrapped into int64 (the protos'
        # type) for a seed near the top of the range.
        seed = sampling.seed + index
        sampling = replace(sampling, seed=seed - 2**64 if seed > _INT64_MAX else seed)
    choice = Request(
        request_id=choice_request_id(first.request_id, index),
        prompt_token_ids=first.prompt_token_ids,
        sampling=sampling,
        eos_token_ids=first.eos_token_ids,
        arrival_time=first.arrival_time,
        deadline=first.deadline,
        cache_salt=first.cache_salt,
        group=group,
        choice_index=index,
    )
    group.choices.append(choice)
    return choice
