"""Which scheduler gets a request (pure logic: no gRPC, no Redis).

cache_aware   the scheduler holding the longest cached prefix of the prompt, unless it is
              overloaded; then, and when no scheduler holds any of it, the least loaded.
least_loaded  the fewest running + waiting requests.
round_robin   in turn, ignoring load and cache (the baseline the benchmark compares against).

Ties go round-robin, so equal schedulers share the load. A scheduler whose stats could not be
read is picked only when no other one answers.

A request run with a LoRA adapter goes only to schedulers whose worker holds the adapter;
among those the ones where it is active (in a device slot) come first unless overloaded, then
the policy above. A request for an adapter not in a slot waits for one, and taking a slot may
push out an adapter other requests were about to use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from services.common.prefix_hash import BlockHash

RoutingPolicy = Literal["cache_aware", "least_loaded", "round_robin"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("cache_aware", "least_loaded", "round_robin")

AdapterState = Literal["missing", "loaded", "active"]
"""Where a request's LoRA adapter is on a scheduler's worker: missing (it cannot serve the
request), loaded (copied into a device slot before the request's first step), active (in a
slot now)."""


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    num_running: int
    num_waiting: int
    num_sent_since_poll: int = 0
    """Requests this replica sent after the stats were read: load the stats do not show yet."""

    @property
    def num_queued(self) -> int:
        return self.num_waiting + self.num_sent_since_poll

    @property
    def total(self) -> int:
        return self.num_running + self.num_queued


@dataclass(frozen=True, slots=True)
class Candidate:
    cached_blocks: int
    """Leading full blocks of the prompt this scheduler holds (per the prefix index)."""
    load: SchedulerLoad | None
    """None: the last stats poll failed (down, or its worker is not connected)."""
    adapter: AdapterState = "loaded"
    """The request's LoRA adapter on this scheduler (a base-model request: "loaded" on all)."""


def choose_scheduler(
    candidates: Sequence[Candidate],
    policy: RoutingPolicy,
    *,
    turn: int,
    overload_queued: int,
) -> int:
    """Index of the chosen candidate. `turn` increases per call (rotates ties);
    `overload_queued`: a scheduler with at least this many queued requests is overloaded.
    ValueError when no candidate holds the request's adapter (the caller checks first)."""
    able = [i for i, c in enumerate(candidates) if c.adapter != "missing"]
    if not able:
        raise ValueError("no scheduler to choose from (none, or none holds the adapter)")
    if policy == "round_robin":
        return able[turn % len(able)]
    answering = [i for i in able if candidates[i].load is not None]
    pool = answering or able
    active = [
        i
        for i in pool
        if candidates[i].adapter == "active" and not _overloaded(candidates[i], overload_queued)
    ]
    pool = active or pool
    if policy == "cache_aware":
        best = max(candidates[i].cached_blocks for i in pool)
        if best > 0:
            holders = [
                i
                for i in pool
                if candidates[i].cached_blocks == best
                and not _overloaded(candidates[i], overload_queued)
            ]
            if holders:
                return _least_loaded(candidates, holders, turn)
    return _least_loaded(candidates, pool, turn)


def _overloaded(candidate: Candidate, overload_queued: int) -> bool:
    return candidate.load is not None and candidate.load.num_queued >= overload_queued


def _least_loaded(candidates: Sequence[Candidate], indices: Sequence[int], turn: int) -> int:
    def total(i: int) -> int:
        load = candidates[i].load
        return load.total if load is not None else 0

    lowest = min(total(i) for i in indices)
    tied = [i for i in indices if total(i) == lowest]
    return tied[turn % len(tied)]


class RecentRoutes:
    """Where this replica recently sent each prefix block (a bounded LRU of block hashes).

    The Redis index only knows blocks once computed; a burst of requests sharing a cold prefix
    would otherwise spread over every scheduler and compute it on each. Remembering our own
    routing sends them to one (until it is overloaded), and works without Redis too. A
    scheduler is remembered by address, not by its place in the list: schedulers join and
    leave (DNS discovery), which shifts places.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[BlockHash, str] = OrderedDict()

    def leading_blocks(
        self, block_hashes: Sequence[BlockHash], schedulers: Sequence[str]
    ) -> list[int]:
        """Per scheduler of `schedulers` (addresses): leading blocks of this prompt last sent
        to it."""
        counts = [0] * len(schedulers)
        owner = self._owner.get(block_hashes[0]) if block_hashes else None
        if owner is None or owner not in schedulers:
            return counts
        index = schedulers.index(owner)
        for block_hash in block_hashes:
            if self._owner.get(block_hash) != owner:
                break
            counts[index] += 1
        return counts

    def remember(self, block_hashes: Sequence[BlockHash], scheduler: str) -> None:
        for block_hash in block_hashes:
            self._owner[block_hash] = scheduler
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
