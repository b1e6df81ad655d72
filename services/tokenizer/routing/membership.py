"""Which schedulers this tokenizer replica routes to (pure logic: no gRPC, DNS or clock).

The --scheduler list holds fixed addresses (host:port) and DNS names (dns:NAME:PORT: a
Kubernetes headless Service, whose name resolves to one A/AAAA record per ready pod). Every
address a name resolves to, with the entry's port, is one scheduler. The pool re-resolves each
name every scheduler_resolve_s and hands the answer to `Membership`, which decides who joins
and who leaves:

    listed by DNS ──► pending ──GetStats answers──► active ──missing twice in a row──► left
                         └───────────────missing twice in a row────────────────────────┘

- A newly listed address joins as pending: the pool opens its channel and polls it, but
  routes nothing to it until its GetStats answers (its worker is connected).
- An address leaves once MISSES_BEFORE_LEAVING resolutions in a row do not list it. One miss
  is not enough: DNS answers can briefly lack a ready pod (a record cache refreshing, an
  endpoint update racing the query), and draining a healthy scheduler would throw away its
  channel and, when it comes back, its place in routing until it answers again. A scheduler
  that is really going away is avoided by routing before it leaves anyway: it stops answering
  GetStats when it starts to drain, and routing prefers the schedulers that answer.
- A failed resolution (NXDOMAIN, a timeout) changes nothing: the last known set stays, and the
  pool warns once per failure streak. An empty answer counts as a failure: seen from here a
  Service with no ready pod and a broken DNS look alike, and a replica that dropped every
  scheduler could not serve either way.
- Fixed addresses never leave, and are active from the start (as before discovery existed: a
  fixed scheduler that does not answer stays a last resort for routing).

What a scheduler's in-flight requests see when it leaves (the pool applies it): it leaves
routing at once (no new request), and its Submit streams may run on. While the scheduler still
answers they finish normally, for up to the tokenizer's drain_s; then its channel closes and any
stream still open ends with UNAVAILABLE ("scheduler ... left the pool"), which clients may retry.
A scheduler that stopped answering ends its streams itself: a killed process resets the
connection at once, a vanished host is caught by the channel's keepalive (about 15 s), both
UNAVAILABLE. No stream hangs, and none ends UNKNOWN or CANCELLED.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

DNS_PREFIX = "dns:"
MISSES_BEFORE_LEAVING = 2
"""Resolutions in a row that must not list an address before it leaves (the flap guard)."""

MemberState = Literal["pending", "active"]
MEMBER_STATES: tuple[MemberState, ...] = ("pending", "active")


@dataclass(frozen=True, slots=True)
class DnsName:
    """A dns:NAME:PORT entry: every address NAME resolves to, at PORT."""

    name: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_PREFIX}{self.name}:{self.port}"


SchedulerEntry = str | DnsName
"""One --scheduler entry: a fixed host:port, or a DNS name to resolve."""


def parse_scheduler_entries(text: str, field_name: str = "scheduler") -> tuple[SchedulerEntry, ...]:
    """'a:1, dns:pairs.svc:50060' → ('a:1', DnsName('pairs.svc', 50060)). ValueError naming
    `field_name` and the entry at fault. Fixed entries are any gRPC target, as before."""
    entries: list[SchedulerEntry] = []
    for part in text.split(","):
        entry = part.strip()
        if not entry:
            continue
        entries.append(_dns_name(entry, field_name) if entry.startswith(DNS_PREFIX) else entry)
    if not entries:
        raise ValueError(f"{field_name}: at least one scheduler (host:port or dns:NAME:PORT)")
    return tuple(entries)


def _dns_name(entry: str, field_name: str) -> DnsName:
    name, _, port_text = entry.removeprefix(DNS_PREFIX).rpartition(":")
    name = name.removeprefix("[").removesuffix("]")  # an IPv6 literal, as in [::1]:50060
    problem = ""
    if not name or not port_text:
        problem = "expected dns:NAME:PORT"
    elif "/" in name or any(c.isspace() for c in name):
        # gRPC's own dns:///host:port syntax is not this one.
        problem = "NAME must be a host name (no '/' nor spaces): expected dns:NAME:PORT"
    elif not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        problem = "PORT must be a number in [1, 65535]"
    if problem:
        raise ValueError(f"{field_name}: bad entry {entry!r}: {problem}")
    return DnsName(name, int(port_text))


def scheduler_address(host: str, port: int) -> str:
    """A resolved IP and the entry's port as a gRPC target: IPv6 in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class Member:
    address: str
    state: MemberState
    fixed: bool = False
    """Given as host:port: never leaves."""
    misses: dict[DnsName, int] = field(default_factory=dict)
    """Per name that lists this address: resolutions in a row since it last did (0: listed by
    the latest one). It leaves when no fixed entry nor name holds it any more."""


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """What one resolution changed, for the pool to apply and log."""

    joined: tuple[str, ...] = ()
    """New members, pending: open their channels."""
    left: tuple[str, ...] = ()
    """Former members: out of routing now; drain, then close their channels."""
    failure_started: bool = False
    """This failure starts a streak (warn once, not at every attempt)."""
    recovered: bool = False
    """The name resolves again after a failure streak."""


class Membership:
    """The members (address → state) in a stable order: fixed entries first, then DNS
    addresses in the order they joined (routing and its ties depend on the order)."""

    def __init__(
        self, entries: Sequence[SchedulerEntry], misses_before_leaving: int = MISSES_BEFORE_LEAVING
    ) -> None:
        if misses_before_leaving < 1:
            raise ValueError(f"misses_before_leaving must be >= 1, got {misses_before_leaving}")
        self.misses_before_leaving = misses_before_leaving
        self.names: tuple[DnsName, ...] = tuple(
            dict.fromkeys(e for e in entries if isinstance(e, DnsName))
        )
        self.members: dict[str, Member] = {
            address: Member(address, "active", fixed=True)
            for address in entries
            if isinstance(address, str)
        }
        self._failures: dict[DnsName, int] = {}

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self.members)

    @property
    def active(self) -> tuple[str, ...]:
        """The addresses routing may choose from."""
        return tuple(a for a, m in self.members.items() if m.state == "active")

    def count(self, state: MemberState) -> int:
        return sum(m.state == state for m in self.members.values())

    def resolved(self, name: DnsName, hosts: Sequence[str] | None) -> MembershipChange:
        """Apply one resolution of `name`: `hosts` are the IP addresses it resolved to, None
        when it failed. A failure or an empty answer keeps every member."""
        if name not in self.names:
            raise ValueError(f"{name} is not one of the scheduler entries")
        if not hosts:
            self._failures[name] = self._failures.get(name, 0) + 1
            return MembershipChange(failure_started=self._failures[name] == 1)
        recovered = self._failures.pop(name, 0) > 0
        listed = list(dict.fromkeys(scheduler_address(h, name.port) for h in hosts))
        joined: list[str] = []
        for address in listed:
            member = self.members.get(address)
            if member is None:
                member = self.members[address] = Member(address, "pending")
                joined.append(address)
            member.misses[name] = 0
        left: list[str] = []
        for address, member in list(self.members.items()):
            if name not in member.misses or address in listed:
                continue
            member.misses[name] += 1
            if member.misses[name] < self.misses_before_leaving:
                continue
            del member.misses[name]
            if not member.fixed and not member.misses:
                del self.members[address]
                left.append(address)
        return MembershipChange(tuple(joined), tuple(left), recovered=recovered)

    def answered(self, address: str) -> bool:
        """The scheduler at `address` answered GetStats: a pending member becomes active.
        True when this call made it active."""
        member = self.members.get(address)
        if member is None or member.state == "active":
            return False
        member.state = "active"
        return True
