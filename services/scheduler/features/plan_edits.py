"""Edits to a step plan after a request joined it: blocks appended to its table, or its table's
tail cut. A request new in the plan carries its whole table in `new_sequences`, so the edit
goes there; one already on the worker gets a delta."""

from __future__ import annotations

from services.contracts.step import BatchPlan, NewSequence, SequenceDelta


def new_sequence_in(plan: BatchPlan, request_id: str) -> NewSequence | None:
    return next((s for s in plan.new_sequences if s.request_id == request_id), None)


def send_blocks(plan: BatchPlan, request_id: str, new_blocks: list[int]) -> None:
    """Blocks appended to a table after its request joined the plan."""
    if not new_blocks:
        return
    new_sequence = new_sequence_in(plan, request_id)
    if new_sequence is not None:
        new_sequence.block_ids.extend(new_blocks)
    else:
        plan.block_deltas.append(SequenceDelta(request_id, new_blocks))


def send_truncation(plan: BatchPlan, request_id: str, num_kept: int) -> None:
    """The table keeps its first `num_kept` blocks; the scheduler freed the rest."""
    new_sequence = new_sequence_in(plan, request_id)
    if new_sequence is not None:
        del new_sequence.block_ids[num_kept:]
    else:
        plan.block_truncations[request_id] = num_kept
