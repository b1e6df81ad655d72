"""Fair shares of a scheduler between tenants: pure rules over the waiting and running lists.

A busy scheduler is shared by seats (the max_num_seqs sequences of a step): each tenant with
requests held (waiting or running) is entitled to seats in proportion to its weight (the key
file's `weight=N`; requests that name no tenant are one tenant, ""). Three rules follow, each
used by one hook in the scheduler core:

- admission order: waiting requests are admitted tenant by tenant, always to the tenant
  holding the fewest seats for its weight, first come first served within a tenant;
- a seat for a tenant under its share: when every seat is taken, the most recent request of
  the tenant most over its share is preempted, but only while that tenant stays at or above
  its share afterwards, so seats never swing back and forth;
- the preemption victim when KV blocks run out: the latest request of the tenant most over its
  share, among the requests not yet scheduled in this step;
- queue room: a full queue still takes a request whose tenant holds less than its share of
  it, up to twice the bound.

Seats are what a decode step shares: a seat produces one token per step, so a tenant's share
of seats is its share of output tokens while its requests run. With a single tenant every rule
reduces to first come first served (the order of the lists), which is also what the scheduler
does with fair shares off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from services.scheduler.request import Request

MAX_TENANTS = 1024


class FairShare:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._weights: dict[str, int] = {}

    def note(self, request: Request, held: Iterable[Request]) -> None:
        """A request arrived: its tenant's weight is the latest its key carried. Requests
        may name any tenant, so past MAX_TENANTS the tenants holding nothing in `held` (read
        only then) are forgotten."""
        if len(self._weights) >= MAX_TENANTS and request.tenant_id not in self._weights:
            active = {r.tenant_id for r in held}
            self._weights = {t: w for t, w in self._weights.items() if t in active}
        self._weights[request.tenant_id] = max(1, request.tenant_weight)

    def weight(self, tenant_id: str) -> int:
        return self._weights.get(tenant_id, 1)

    def _single_tenant(self, *queues: Iterable[Request]) -> bool:
        if len(self._weights) <= 1:
            return True  # every request so far named the same tenant: nothing to scan
        tenants = {request.tenant_id for queue in queues for request in queue}
        return len(tenants) <= 1

    def _shares(self, tenants: Iterable[str], total: int) -> dict[str, float]:
        weights = {tenant: self.weight(tenant) for tenant in tenants}
        sum_weights = sum(weights.values())
        return {tenant: total * w / sum_weights for tenant, w in weights.items()}

    # ---- admission order ---------------------------------------------------------------

    def next_to_admit(
        self, waiting: Sequence[Request], running: Sequence[Request], passed_over: set[str]
    ) -> Request | None:
        """The waiting request to try next (None: none left): the first in the queue not
        passed over; with several tenants, the first of the tenant that would hold the fewest
        seats per weight with it (ties: the tenant whose request came first)."""
        if not self.enabled or len(self._weights) <= 1:
            # One tenant ever seen: the queue's order, with no list built per admission.
            return next((r for r in waiting if r.request_id not in passed_over), None)
        candidates = [r for r in waiting if r.request_id not in passed_over]
        if not candidates:
            return None
        if self._single_tenant(candidates, running):
            return candidates[0]
        seats = Counter(request.tenant_id for request in running)
        firsts: dict[str, Request] = {}
        for request in candidates:
            firsts.setdefault(request.tenant_id, request)
        tenant = min(firsts, key=lambda t: (seats[t] + 1) / self.weight(t))  # dicts keep order
        return firsts[tenant]

    # ---- seats for tenants under their share -------------------------------------------

    def seats_to_free(
        self,
        waiting: Sequence[Request],
        running: Sequence[Request],
        num_seats: int,
        num_free: int,
        is_runnable: Callable[[Request], bool] = lambda request: True,
    ) -> list[Request]:
        """Running requests to preempt so that waiting tenants under their share of the
        `num_seats` seats get theirs: one per runnable waiting request of such a tenant that
        the `num_free` free seats do not cover, each taken from the tenant most over its
        share, and only while that tenant stays at or above its share."""
        if not self.enabled or not waiting or self._single_tenant(waiting, running):
            return []
        seats = Counter(request.tenant_id for request in running)
        shares = self._shares({r.tenant_id for r in (*waiting, *running)}, num_seats)
        wanted = Counter(r.tenant_id for r in waiting if is_runnable(r))
        taken: dict[str, list[Request]] = {}
        for request in running:
            taken.setdefault(request.tenant_id, []).append(request)
        victims: list[Request] = []
        while True:
            under = [t for t in wanted if wanted[t] > 0 and seats[t] + 1 <= shares[t]]
            if not under:
                return victims
            tenant = min(under, key=lambda t: seats[t] / self.weight(t))
            if num_free > 0:
                num_free -= 1
            else:
                donors = [t for t in taken if taken[t] and seats[t] - 1 >= shares[t]]
                if not donors:
                    return victims
                donor = max(donors, key=lambda t: seats[t] / self.weight(t))
                victims.append(taken[donor].pop())  # its latest arrival
                seats[donor] -= 1
            seats[tenant] += 1
            wanted[tenant] -= 1

    # ---- preemption under memory pressure ----------------------------------------------

    def victim(self, running: Sequence[Request], candidates: Sequence[Request]) -> Request:
        """Whom to preempt among `candidates` (a non-empty tail of `running`, which is in
        arrival order): the latest of the tenant most over its share of the running seats."""
        if not self.enabled or self._single_tenant(running):
            return candidates[-1]
        seats = Counter(request.tenant_id for request in running)
        tenants = {request.tenant_id for request in candidates}
        most_over = max(tenants, key=lambda t: seats[t] / self.weight(t))
        return next(r for r in reversed(candidates) if r.tenant_id == most_over)

    # ---- queue room --------------------------------------------------------------------

    def may_exceed_bound(self, request: Request, held: Sequence[Request], bound: int) -> bool:
        """Whether a request may be queued although `bound` requests are held: its tenant
        holds less than its share of the bound, and the overflow stays under the bound
        itself (at most twice the bound held in all)."""
        if not self.enabled or len(held) >= 2 * bound:
            return False
        counts = Counter(r.tenant_id for r in held)
        tenants = {*counts, request.tenant_id}
        if len(tenants) <= 1:
            return False
        weights = {t: self.weight(t) for t in tenants}
        weights[request.tenant_id] = max(1, request.tenant_weight)
        share = bound * weights[request.tenant_id] / sum(weights.values())
        return counts[request.tenant_id] + 1 <= share
