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

Prefix fetch (docs/prefix-cache.md) takes the same path for part of a prompt: a request whose
routing named another pair holding more of its prefix is admitted with blocks up to the end of
that prefix and awaits their KV from that pair's pool (ExportKv, nothing computed there); once
in place they count as cached and it prefills the rest here.

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
    num_prefix_tokens: int = 0
    """A prefix fetch: the tokens (whole blocks) whose KV comes from the other pair's cache,
    which computes nothing; 0: a remote prefill of the whole prompt and its first token."""


class RemotePrefills:
    """Which requests prefill elsewhere (decode side) or send their KV elsewhere (prefill
    side), by request id; the scheduler asks at admission, scheduling and preemption."""

    def __init__(self) -> None:
        # queued: request id → (prefill or exporting scheduler, prefix tokens; 0 = whole prompt)
        self._wanted: dict[str, tuple[str, int]] = {}
        self._awaiting: dict[str, Handoff] = {}  # admitted, blocks reserved, KV not here yet
        self._new_handoffs: list[Handoff] = []  # for the shell, taken after each schedule
        self._destinations: dict[str, KvDestination] = {}  # prefill side

    # ---- decode side ----------------------------------------------------------------------

    def hold(self, request_id: str, prefill_scheduler: str, num_prefix_tokens: int = 0) -> None:
        """Queue `request_id` to be prefilled on `prefill_scheduler` once admitted; with
        `num_prefix_tokens`, to fetch that prefix's KV from that scheduler's cache instead."""
        self._wanted[request_id] = (prefill_scheduler, num_prefix_tokens)

    def prefills_whole(self, request: Request) -> bool:
        """Queued for a remote prefill of its whole prompt (no block of it is loaded here)."""
        wanted = self._wanted.get(request.request_id)
        return wanted is not None and wanted[1] == 0

    def wants_remote(self, request: Request, num_cached: int) -> bool:
        """Admit it for a remote prefill or prefix fetch, with `num_cached` tokens found here?
        Only a request that has computed nothing yet (a preempted one was running here: it
        recomputes here), and for a fetch only while the other pair holds more than this one:
        else the fetch is dropped."""
        wanted = self._wanted.get(request.request_id)
        if wanted is None or request.num_output_tokens:
            return False
        if wanted[1] and wanted[1] <= num_cached:
            del self._wanted[request.request_id]
            return False
        return True

    def num_tokens_to_reserve(self, request: Request, num_cached: int) -> int:
        """Tokens the admission allocates blocks for, beyond the cached prefix, whatever the
        step's budget (none of them is computed here): the whole prompt, or the fetched
        prefix."""
        num_prefix_tokens = self._wanted[request.request_id][1]
        return (num_prefix_tokens or request.num_tokens) - num_cached

    def on_reserved(
        self, request: Request, num_cached: int, block_size: int, block_table: list[int]
    ) -> Handoff:
        """The request was admitted with `block_table` (its cached blocks first)."""
        first_block = num_cached // block_size
        scheduler, num_prefix_tokens = self._wanted.pop(request.request_id)
        handoff = Handoff(
            request.request_id,
            scheduler,
            first_block,
            list(block_table[first_block:]),
            num_prefix_tokens,
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

    def end_wait(self, request_id: str) -> Handoff | None:
        """The KV arrived, or will not: the request leaves the awaiting state. Its handoff;
        None when it was not awaiting (finished or aborted meanwhile)."""
        return self._awaiting.pop(request_id, None)

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
