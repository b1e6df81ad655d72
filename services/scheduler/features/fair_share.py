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

Which tenant each request is of is kept here, by the id its owner submitted (every choice of
a request with n > 1 is of its tenant), from when it is queued until it leaves.

Seats are what a decode step shares: a seat produces one token per step, so a tenant's share
of seats is its share of output tokens while its requests run. With speculative decoding a seat
may produce more (its accepted drafts): the share is still of seats, i.e. of the steps' work,
and a tenant whose answers repeat what it sent gets more tokens from the same seats. With a
single tenant every rule reduces to first come first served (the order of the lists), which is
also what the scheduler does with fair shares off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.request import Request

MAX_TENANTS = 1024


@dataclass(frozen=True, slots=True)
class Tenant:
    """Whose share of the scheduler a request uses, and that tenant's weight (its key's)."""

    tenant_id: str = ""
    """"" = no tenant named: every such request is of one tenant."""
    weight: int = 1


NO_TENANT = Tenant()


def _own_id(request: Request) -> str:
    return request.request_id


class FairShare:
    def __init__(self, enabled: bool = True, public_id: Callable[[Request], str] = _own_id) -> None:
        """`public_id`: the id a sequence's owner submitted (a forked choice's request's)."""
        self.enabled = enabled
        self._weights: dict[str, int] = {}
        self._tenants: dict[str, str] = {}
        """Submitted request id -> its tenant, for requests held that named one."""
        self._public_id = public_id

    def note(self, tenant: Tenant, held: Iterable[Request]) -> None:
        """A request arrived: its tenant's weight is the latest its key carried. Requests
        may name any tenant, so past MAX_TENANTS the tenants holding nothing in `held` (read
        only then) are forgotten."""
        if len(self._weights) >= MAX_TENANTS and tenant.tenant_id not in self._weights:
            active = {self.tenant_of(r) for r in held}
            self._weights = {t: w for t, w in self._weights.items() if t in active}
        self._weights[tenant.tenant_id] = max(1, tenant.weight)

    def on_queued(self, request_id: str, tenant: Tenant) -> None:
        """The request (a submitted id) was queued: its sequences are `tenant`'s."""
        if tenant.tenant_id:
            self._tenants[request_id] = tenant.tenant_id

    def forget(self, request_id: str) -> None:
        """The request (a submitted id) left: none of its sequences is held."""
        self._tenants.pop(request_id, None)

    def request_ids(self) -> set[str]:
        """The submitted ids it keeps a tenant for (the core's integrity check)."""
        return set(self._tenants)

    def tenant_of(self, request: Request) -> str:
        return self._tenants.get(self._public_id(request), "")

    def weight(self, tenant_id: str) -> int:
        return self._weights.get(tenant_id, 1)

    def _single_tenant(self, *queues: Iterable[Request]) -> bool:
        if len(self._weights) <= 1:
            return True  # every request so far named the same tenant: nothing to scan
        tenants = {self.tenant_of(request) for queue in queues for request in queue}
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
        seats = Counter(self.tenant_of(request) for request in running)
        firsts: dict[str, Request] = {}
        for request in candidates:
            firsts.setdefault(self.tenant_of(request), request)
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
        seats = Counter(self.tenant_of(request) for request in running)
        shares = self._shares({self.tenant_of(r) for r in (*waiting, *running)}, num_seats)
        wanted = Counter(self.tenant_of(r) for r in waiting if is_runnable(r))
        taken: dict[str, list[Request]] = {}
        for request in running:
            taken.setdefault(self.tenant_of(request), []).append(request)
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
        seats = Counter(self.tenant_of(request) for request in running)
        tenants = {self.tenant_of(request) for request in candidates}
        most_over = max(tenants, key=lambda t: seats[t] / self.weight(t))
        return next(r for r in reversed(candidates) if self.tenant_of(r) == most_over)

    # ---- queue room --------------------------------------------------------------------

    def may_exceed_bound(self, tenant: Tenant, held: Sequence[Request], bound: int) -> bool:
        """Whether a request of `tenant` may be queued although `bound` requests are held:
        the tenant holds less than its share of the bound, and the overflow stays under the
        bound itself (at most twice the bound held in all)."""
        if not self.enabled or len(held) >= 2 * bound:
            return False
        counts = Counter(self.tenant_of(r) for r in held)
        tenants = {*counts, tenant.tenant_id}
        if len(tenants) <= 1:
            return False
        weights = {t: self.weight(t) for t in tenants}
        weights[tenant.tenant_id] = max(1, tenant.weight)
        share = bound * weights[tenant.tenant_id] / sum(weights.values())
        return counts[tenant.tenant_id] + 1 <= share
