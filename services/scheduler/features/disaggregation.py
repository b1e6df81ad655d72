"""Prefill/decode disaggregation in the scheduler core (docs/disaggregation.md).

Decode side: a request submitted with a prefill scheduler is admitted like any other (seat,
prefix-cache hit, blocks) but for its whole prompt at once, and then *awaits KV*: it holds its
blocks and seat, is never scheduled and never preempted (the transfer must never land in
blocks given to someone else). The step loop's shell (services/scheduler/kv_handoff.py) takes
the handoff, asks the prefill pair for the prompt's KV and first token, then either completes
the request (the prompt counts as computed) or falls back (it prefills here, in the blocks it
already holds).

Prefill side: a request submitted with a KV destination carries it into its NewSequence; the
worker sends the prompt's blocks there with the first token (services/worker/kv_transfer.py).

    a decode request's life:   waiting ──admit──▶ awaiting KV ──complete──▶ running (decodes)
                                                       └──────fall back───▶ running (prefills)
"""

from __future__ import annotations

from dataclasses import dataclass

from services.contracts.kv_transfer import KvDestination
from services.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class Handoff:
    """An admitted request whose prompt's KV a prefill scheduler is to compute and send."""

    request_id: str
    prefill_scheduler: str
    """The prefill scheduler's address (host:port)."""
    first_block: int
    """Prompt blocks before this one were cached here: the prefill worker skips them."""
    block_ids: list[int]
    """This side's blocks for prompt blocks first_block, first_block + 1, ..."""


class RemotePrefills:
    """Which requests prefill elsewhere (decode side) or send their KV elsewhere (prefill
    side), by request id; the scheduler asks at admission, scheduling and preemption."""

    def __init__(self) -> None:
        self._wanted: dict[str, str] = {}  # queued: request id → prefill scheduler
        self._awaiting: dict[str, Handoff] = {}  # admitted, blocks reserved, KV not here yet
        self._new_handoffs: list[Handoff] = []  # for the shell, taken after each schedule
        self._destinations: dict[str, KvDestination] = {}  # prefill side

    # ---- decode side ----------------------------------------------------------------------

    def hold(self, request_id: str, prefill_scheduler: str) -> None:
        """Queue `request_id` to be prefilled on `prefill_scheduler` once admitted."""
        self._wanted[request_id] = prefill_scheduler

    def wants_remote(self, request: Request) -> bool:
        """Admit it for a remote prefill? Only a request that has computed nothing yet: a
        preempted one (it was running here) recomputes here."""
        return request.request_id in self._wanted and request.num_output_tokens == 0

    def num_tokens_to_reserve(self, request: Request, num_cached: int) -> int:
        """Tokens the admission allocates blocks for, beyond the cached prefix: the whole
        prompt, whatever the step's budget (none of it is computed here)."""
        return request.num_tokens - num_cached

    def on_reserved(
        self, request: Request, num_cached: int, block_size: int, block_table: list[int]
    ) -> Handoff:
        """The request was admitted with `block_table` (its cached blocks first)."""
        first_block = num_cached // block_size
        handoff = Handoff(
            request.request_id,
            self._wanted.pop(request.request_id),
            first_block,
            list(block_table[first_block:]),
        )
        self._awaiting[request.request_id] = handoff
        self._new_handoffs.append(handoff)
        return handoff

    def is_awaiting(self, request: Request) -> bool:
        return request.request_id in self._awaiting

    @property
    def num_awaiting(self) -> int:
        return len(self._awaiting)

    def take_new_handoffs(self) -> list[Handoff]:
        handoffs, self._new_handoffs = self._new_handoffs, []
        return handoffs

    def end_wait(self, request_id: str) -> bool:
        """The KV arrived, or will not: the request leaves the awaiting state. False when it
        was not awaiting (finished or aborted meanwhile)."""
        return self._awaiting.pop(request_id, None) is not None

    # ---- prefill side ---------------------------------------------------------------------

    def send_to(self, request_id: str, destination: KvDestination) -> None:
        self._destinations[request_id] = destination

    def destination(self, request_id: str) -> KvDestination | None:
        return self._destinations.get(request_id)

    # ---- both ------------------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)
        self._awaiting.pop(request_id, None)
        self._destinations.pop(request_id, None)
        self._new_handoffs = [h for h in self._new_handoffs if h.request_id != request_id]

    def request_ids(self) -> set[str]:
        return {*self._wanted, *self._awaiting, *self._destinations}
