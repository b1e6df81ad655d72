"""Scheduler membership (pure): who joins and leaves as DNS answers change, the flap guard,
DNS failures, fixed addresses, pending → active, and the dns: entries of --scheduler."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.routing.membership import (
    DnsName,
    Membership,
    parse_scheduler_entries,
    scheduler_address,
)
from services.tokenizer.routing.pool import resolve_ips

PAIRS = DnsName("pairs.llmserve.svc.cluster.local", 50060)


def test_listed_addresses_join_pending_and_enter_routing_once_they_answer() -> None:
    membership = Membership([PAIRS])
    change = membership.resolved(PAIRS, ["10.0.0.2", "10.0.0.1"])
    assert change.joined == ("10.0.0.2:50060", "10.0.0.1:50060") and change.left == ()
    assert membership.count("pending") == 2 and membership.active == ()
    assert membership.answered("10.0.0.1:50060")
    assert not membership.answered("10.0.0.1:50060")  # already active
    assert not membership.answered("10.9.9.9:50060")  # not a member
    assert membership.active == ("10.0.0.1:50060",)
    assert membership.addresses == ("10.0.0.2:50060", "10.0.0.1:50060")  # join order
    assert membership.resolved(PAIRS, ["10.0.0.1", "10.0.0.2"]).joined == ()


def test_an_address_leaves_only_after_two_resolutions_in_a_row_miss_it() -> None:
    membership = Membership([PAIRS])
    membership.resolved(PAIRS, ["10.0.0.1", "10.0.0.2"])
    membership.answered("10.0.0.2:50060")
    assert membership.resolved(PAIRS, ["10.0.0.1"]).left == ()  # one miss: a flap, maybe
    assert membership.resolved(PAIRS, ["10.0.0.1", "10.0.0.2"]).left == ()  # it was
    assert membership.active == ("10.0.0.2:50060",)  # still active: no re-gating
    assert membership.resolved(PAIRS, ["10.0.0.1"]).left == ()
    assert membership.resolved(PAIRS, ["10.0.0.1"]).left == ("10.0.0.2:50060",)
    assert membership.addresses == ("10.0.0.1:50060",)
    # Back later: a new member, pending again.
    assert membership.resolved(PAIRS, ["10.0.0.1", "10.0.0.2"]).joined == ("10.0.0.2:50060",)
    assert membership.members["10.0.0.2:50060"].state == "pending"


def test_a_failed_or_empty_resolution_keeps_every_member_and_warns_once() -> None:
    membership = Membership([PAIRS])
    membership.resolved(PAIRS, ["10.0.0.1"])
    first = membership.resolved(PAIRS, None)  # NXDOMAIN, a timeout
    assert first.failure_started and first.joined == first.left == ()
    for answer in (None, [], None):  # an empty answer is a failure too
        change = membership.resolved(PAIRS, answer)
        assert not change.failure_started and change.left == ()
    assert membership.addresses == ("10.0.0.1:50060",)
    back = membership.resolved(PAIRS, ["10.0.0.1"])
    assert back.recovered and back.joined == back.left == ()
    assert not membership.resolved(PAIRS, ["10.0.0.1"]).recovered
    assert membership.resolved(PAIRS, None).failure_started  # a new streak warns again


def test_failures_do_not_count_as_misses() -> None:
    membership = Membership([PAIRS])
    membership.resolved(PAIRS, ["10.0.0.1", "10.0.0.2"])
    membership.resolved(PAIRS, ["10.0.0.1"])  # miss 1
    membership.resolved(PAIRS, None)
    assert membership.resolved(PAIRS, ["10.0.0.1"]).left == ("10.0.0.2:50060",)  # miss 2


def test_fixed_addresses_are_active_from_the_start_and_never_leave() -> None:
    membership = Membership(["10.0.0.1:50060", PAIRS, "sched-b:50061"])
    assert membership.active == ("10.0.0.1:50060", "sched-b:50061")
    membership.resolved(PAIRS, ["10.0.0.1", "10.0.0.3"])  # one address both fixed and listed
    assert membership.resolved(PAIRS, ["10.0.0.3"]).left == ()
    assert membership.resolved(PAIRS, ["10.0.0.3"]).left == ()
    assert membership.addresses == ("10.0.0.1:50060", "sched-b:50061", "10.0.0.3:50060")


def test_an_address_listed_by_two_names_stays_while_either_lists_it() -> None:
    other = DnsName("other.svc", 50060)
    membership = Membership([PAIRS, other])
    membership.resolved(PAIRS, ["10.0.0.1"])
    assert membership.resolved(other, ["10.0.0.1"]).joined == ()
    for _ in range(3):
        assert membership.resolved(PAIRS, ["10.0.0.9"]).left == ()
    membership.resolved(other, ["10.0.0.9"])
    assert membership.resolved(other, ["10.0.0.9"]).left == ("10.0.0.1:50060",)


def test_ipv6_addresses_are_bracketed() -> None:
    assert scheduler_address("10.0.0.1", 50060) == "10.0.0.1:50060"
    assert scheduler_address("fd00::1", 50060) == "[fd00::1]:50060"
    membership = Membership([PAIRS])
    assert membership.resolved(PAIRS, ["fd00::1", "10.0.0.1"]).joined == (
        "[fd00::1]:50060",
        "10.0.0.1:50060",
    )


def test_a_name_that_is_not_an_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of the scheduler entries"):
        Membership([PAIRS]).resolved(DnsName("stranger", 1), ["10.0.0.1"])


# ---- the --scheduler entries ---------------------------------------------------------------


def test_scheduler_entries_mix_fixed_addresses_and_dns_names() -> None:
    entries = parse_scheduler_entries(
        " a:1 , dns:pairs.llmserve.svc.cluster.local:50060,, dns:[::1]:7,b:2"
    )
    assert entries == ("a:1", PAIRS, DnsName("::1", 7), "b:2")
    assert str(PAIRS) == "dns:pairs.llmserve.svc.cluster.local:50060"
    config = TokenizerConfig(scheduler="dns:pairs:50060", scheduler_resolve_s=0.5)
    assert config.scheduler_entries == (DnsName("pairs", 50060),)
    assert TokenizerConfig().scheduler_entries == ("127.0.0.1:50060",)


@pytest.mark.parametrize(
    ("scheduler", "message"),
    [
        ("a:1,dns:pairs", r"scheduler: bad entry 'dns:pairs': expected dns:NAME:PORT"),
        ("dns::50060", r"bad entry 'dns::50060': expected dns:NAME:PORT"),
        ("dns:pairs:", r"bad entry 'dns:pairs:': expected"),
        ("dns:pairs:http", r"bad entry 'dns:pairs:http': PORT must be a number"),
        ("dns:pairs:70000", r"bad entry 'dns:pairs:70000': PORT must be a number in \[1, 65535\]"),
        ("dns:pairs:0", r"PORT must be a number"),
        ("dns:///pairs:50060", r"bad entry 'dns:///pairs:50060': NAME must be a host name"),
        ("dns:pa irs:50060", r"NAME must be a host name"),
        (" , ", r"scheduler: at least one scheduler"),
    ],
)
def test_bad_scheduler_entries_are_refused_naming_the_field_and_entry(
    scheduler: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TokenizerConfig(scheduler=scheduler)


@pytest.mark.parametrize("resolve_s", [0.0, -1.0])
def test_scheduler_resolve_s_must_be_positive(resolve_s: float) -> None:
    with pytest.raises(ValueError, match="scheduler_resolve_s must be > 0"):
        TokenizerConfig(scheduler_resolve_s=resolve_s)


def test_scheduler_resolve_s_is_a_flag_and_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from services.common.config_flags import add_config_flags, config_from_args

    monkeypatch.setenv("LLMSERVE_SCHEDULER_RESOLVE_S", "2.5")
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TokenizerConfig)
    from_env = config_from_args(TokenizerConfig, parser.parse_args([]))
    assert from_env.scheduler_resolve_s == 2.5
    args = ["--scheduler-resolve-s", "1", "--scheduler", "dns:pairs:50060,10.0.0.1:50060"]
    from_flags = config_from_args(TokenizerConfig, parser.parse_args(args))
    assert from_flags.scheduler_resolve_s == 1.0
    assert from_flags.scheduler_entries == (DnsName("pairs", 50060), "10.0.0.1:50060")


def test_localhost_resolves_to_loopback() -> None:
    ips = asyncio.run(resolve_ips("localhost", 50060))
    assert ips and set(ips) <= {"127.0.0.1", "::1"}
    assert ips == sorted(set(ips))
    with pytest.raises(socket.gaierror):
        asyncio.run(resolve_ips("no-such-host.invalid", 50060))
