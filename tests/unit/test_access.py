"""Who may call the public API: API keys, admin keys, tenant-bound keys from a key file."""

from __future__ import annotations

import hmac
from pathlib import Path

import pytest

from services.common import shared_secret
from services.contracts.errors import PermissionDeniedError, UnauthenticatedError
from services.tokenizer.access import keys as access
from services.tokenizer.access.keys import (
    AccessPolicy,
    Caller,
    parse_key_file,
    require_admin,
    tenant_for,
)
from services.tokenizer.access.limits import KeyLimits

USER_KEY = "sk-user-0123456789"
ADMIN_KEY = "sk-admin-abcdefghij"
ACME_KEY = "sk-acme-zyxwvuts"


def policy() -> AccessPolicy:
    """A user key, an admin key and a key bound to tenant acme."""
    return AccessPolicy(parse_key_file(f"{USER_KEY}\n{ADMIN_KEY} admin\n{ACME_KEY} tenant=acme\n"))


def bearer(key: str) -> str:
    return f"Bearer {key}"


# ---- authenticate ---------------------------------------------------------------------------


def test_no_key_configured_is_open_and_every_caller_is_an_admin() -> None:
    open_policy = AccessPolicy()
    assert open_policy.open and open_policy.num_keys == 0
    for authorization in (None, "", "Bearer anything", "Basic dXNlcjpwdw=="):
        caller = open_policy.authenticate(authorization)
        assert caller.admin
        assert caller.tenant_id is None


def test_a_bare_key_is_the_same_caller_as_its_bearer_header() -> None:
    keys = policy()
    for key in (USER_KEY, ADMIN_KEY, ACME_KEY):
        assert keys.authenticate_key(key) == keys.authenticate(bearer(key))
    with pytest.raises(UnauthenticatedError):
        keys.authenticate_key("sk-unknown")
    assert AccessPolicy().authenticate_key("anything").admin


def test_a_configured_key_closes_the_policy() -> None:
    closed = AccessPolicy.from_settings(api_keys=[USER_KEY])
    assert not closed.open and closed.num_keys == 1
    with pytest.raises(UnauthenticatedError):
        closed.authenticate(None)


@pytest.mark.parametrize("authorization", [None, ""])
def test_missing_key_is_unauthenticated(authorization: str | None) -> None:
    with pytest.raises(UnauthenticatedError, match="missing API key"):
        policy().authenticate(authorization)


@pytest.mark.parametrize(
    "authorization",
    [
        USER_KEY,  # no scheme at all
        f"Basic {USER_KEY}",
        f"Token {USER_KEY}",
        f"Bearer:{USER_KEY}",
        "Bearer",
    ],
)
def test_a_scheme_other_than_bearer_is_unauthenticated_without_echoing_it(
    authorization: str,
) -> None:
    with pytest.raises(UnauthenticatedError) as raised:
        policy().authenticate(authorization)
    assert "Bearer" in str(raised.value)
    assert USER_KEY not in str(raised.value)


@pytest.mark.parametrize(
    "presented",
    [
        "sk-wrong-key-9999",
        USER_KEY + "x",  # a known key's prefix must not be enough
        USER_KEY[:-1],
        USER_KEY.upper(),
        "",
    ],
)
def test_a_wrong_key_is_unauthenticated_and_never_echoed(presented: str) -> None:
    with pytest.raises(UnauthenticatedError) as raised:
        policy().authenticate(bearer(presented))
    message = str(raised.value)
    assert "invalid API key" in message
    if presented:
        assert presented not in message
    for known in (USER_KEY, ADMIN_KEY, ACME_KEY):
        assert known not in message


def test_the_right_key_gives_its_caller() -> None:
    keys = policy()
    user = keys.authenticate(bearer(USER_KEY))
    admin = keys.authenticate(bearer(ADMIN_KEY))
    acme = keys.authenticate(bearer(ACME_KEY))
    assert (user.admin, user.tenant_id) == (False, None)
    assert (admin.admin, admin.tenant_id) == (True, None)
    assert (acme.admin, acme.tenant_id) == (False, "acme")
    # Each key shows in logs as its own short id, never as the key.
    key_ids = {user.key_id, admin.key_id, acme.key_id}
    assert len(key_ids) == 3
    for caller, key in ((user, USER_KEY), (admin, ADMIN_KEY), (acme, ACME_KEY)):
        assert key not in caller.key_id and len(caller.key_id) <= 16
        assert key not in repr(caller)


def test_the_same_key_always_gives_the_same_key_id() -> None:
    first = AccessPolicy.from_settings(api_keys=[USER_KEY]).authenticate(bearer(USER_KEY))
    second = AccessPolicy.from_settings(api_keys=[USER_KEY]).authenticate(bearer(USER_KEY))
    assert first.key_id == second.key_id


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(scheme: str) -> None:
    assert policy().authenticate(f"{scheme} {USER_KEY}").key_id == (
        policy().authenticate(bearer(USER_KEY)).key_id
    )


def test_spaces_around_the_key_are_ignored() -> None:
    caller = policy().authenticate(f"Bearer   {USER_KEY}  ")
    assert not caller.admin and caller.tenant_id is None


def test_from_settings_merges_flags_and_the_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{ACME_KEY} tenant=acme\n")
    keys = AccessPolicy.from_settings(
        api_keys=[USER_KEY], admin_api_keys=[ADMIN_KEY], api_key_file=str(key_file)
    )
    assert keys.num_keys == 3
    assert not keys.authenticate(bearer(USER_KEY)).admin
    assert keys.authenticate(bearer(ADMIN_KEY)).admin
    assert keys.authenticate(bearer(ACME_KEY)).tenant_id == "acme"


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        AccessPolicy.from_settings(api_keys=["  "])


def test_the_same_key_configured_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice") as raised:
        AccessPolicy.from_settings(api_keys=[USER_KEY], admin_api_keys=[USER_KEY])
    assert USER_KEY not in str(raised.value)
    with pytest.raises(ValueError, match="twice"):
        AccessPolicy(parse_key_file(f"{USER_KEY}\n{USER_KEY} tenant=acme\n"))


COMPARE_DIGEST = hmac.compare_digest


class CountingCompare:
    """hmac.compare_digest, counting its calls and matches."""

    def __init__(self) -> None:
        self.calls = 0
        self.matches = 0

    def __call__(self, a: bytes, b: bytes) -> bool:
        self.calls += 1
        equal = COMPARE_DIGEST(a, b)
        self.matches += equal
        return equal


@pytest.mark.parametrize("presented", [USER_KEY, ADMIN_KEY, ACME_KEY, "sk-unknown"])
def test_every_key_is_compared_whichever_matches(
    monkeypatch: pytest.MonkeyPatch, presented: str
) -> None:
    # Constant time in which key matched: no early exit at the first match (USER_KEY is the
    # first configured), every comparison goes through hmac.compare_digest.
    keys = policy()
    compare = CountingCompare()
    monkeypatch.setattr(shared_secret.hmac, "compare_digest", compare)
    known = presented != "sk-unknown"
    if known:
        keys.authenticate(bearer(presented))
    else:
        with pytest.raises(UnauthenticatedError):
            keys.authenticate(bearer(presented))
    assert compare.calls == keys.num_keys == 3
    assert compare.matches == int(known)


# ---- the key file ---------------------------------------------------------------------------


def test_key_file_comments_blank_lines_and_options() -> None:
    text = f"""
# the team's keys
{USER_KEY}

   {ADMIN_KEY}   admin   # ops
{ACME_KEY} tenant=acme
\t
# {"sk-commented-out"}
"""
    keys = parse_key_file(text)
    assert [(k.caller.admin, k.caller.tenant_id) for k in keys] == [
        (False, None),
        (True, None),
        (False, "acme"),
    ]
    by_key = AccessPolicy(keys)
    assert by_key.authenticate(bearer(ADMIN_KEY)).admin
    assert by_key.authenticate(bearer(ACME_KEY)).tenant_id == "acme"
    with pytest.raises(UnauthenticatedError):
        by_key.authenticate(bearer("sk-commented-out"))


def test_an_empty_key_file_gives_no_keys() -> None:
    assert parse_key_file("") == []
    assert parse_key_file("# nothing yet\n\n") == []


@pytest.mark.parametrize(
    ("line", "line_number"),
    [
        (f"{USER_KEY} tenant:acme", 2),
        (f"{USER_KEY} tenant=", 2),
        (f"{USER_KEY} Admin", 2),
        (f"{USER_KEY} admin=yes", 2),
        (f"{USER_KEY} {ADMIN_KEY}", 2),  # two keys on one line
    ],
)
def test_a_bad_option_names_the_line_and_never_echoes_a_key(line: str, line_number: int) -> None:
    with pytest.raises(ValueError, match=f"keys.txt line {line_number}:") as raised:
        parse_key_file(f"{ACME_KEY} tenant=acme\n{line}\n", "keys.txt")
    assert "tenant=ID, weight=N, max_concurrent=N, rpm=N, tpm=N or admin" in str(raised.value)
    for key in (USER_KEY, ADMIN_KEY, ACME_KEY):
        assert key not in str(raised.value)


def test_a_bad_option_counts_lines_including_comments_and_blanks() -> None:
    with pytest.raises(ValueError, match="line 4:"):
        parse_key_file(f"# header\n\n{USER_KEY}\n{ADMIN_KEY} superuser\n")


def test_an_admin_key_bound_to_a_tenant_is_refused() -> None:
    for line in (f"{ADMIN_KEY} admin tenant=acme", f"{ADMIN_KEY} tenant=acme admin"):
        with pytest.raises(ValueError, match="line 1: an admin key is not bound to a tenant"):
            parse_key_file(line)


# ---- what a caller may do -------------------------------------------------------------------

UNBOUND = Caller("k1")
BOUND = Caller("k2", tenant_id="acme")


def test_an_unbound_key_takes_the_requested_tenant() -> None:
    assert tenant_for(UNBOUND, "globex") == "globex"
    assert tenant_for(UNBOUND, "") == ""


def test_a_bound_key_acts_for_its_own_tenant() -> None:
    assert tenant_for(BOUND, "") == "acme"
    assert tenant_for(BOUND, "acme") == "acme"


def test_a_bound_key_may_not_name_another_tenant() -> None:
    with pytest.raises(PermissionDeniedError) as raised:
        tenant_for(BOUND, "globex", field="tenant_id")
    assert str(raised.value).startswith("tenant_id:")
    assert "globex" in str(raised.value)
    with pytest.raises(PermissionDeniedError, match=r"^prompt\.tenant_id:"):
        tenant_for(BOUND, "globex", field="prompt.tenant_id")


def test_require_admin() -> None:
    require_admin(Caller("a", admin=True), "RegisterPrompt")
    require_admin(access.OPEN_CALLER, "RegisterPrompt")
    for caller in (UNBOUND, BOUND):
        with pytest.raises(PermissionDeniedError, match="DeletePrompt needs an admin API key"):
            require_admin(caller, "DeletePrompt")


def test_an_authenticated_bound_key_cannot_act_for_another_tenant() -> None:
    caller = policy().authenticate(bearer(ACME_KEY))
    with pytest.raises(PermissionDeniedError):
        tenant_for(caller, "globex")
    with pytest.raises(PermissionDeniedError):
        require_admin(caller, "RegisterPrompt")


def test_key_file_weight() -> None:
    keys = parse_key_file(f"{ACME_KEY} tenant=acme weight=3\n{USER_KEY}\n")
    policy = AccessPolicy(keys)
    assert policy.authenticate(f"Bearer {ACME_KEY}").weight == 3
    assert policy.authenticate(f"Bearer {USER_KEY}").weight == 1


@pytest.mark.parametrize("option", ["weight=0", "weight=-1", "weight=x", "weight=", "weight=1001"])
def test_key_file_bad_weight_names_the_line(option: str) -> None:
    with pytest.raises(ValueError, match="line 1: weight must be an integer"):
        parse_key_file(f"{ACME_KEY} {option}\n")


# ---- limits ---------------------------------------------------------------------------------


def test_key_file_limits() -> None:
    keys = parse_key_file(
        f"{ACME_KEY} tenant=acme max_concurrent=2 rpm=60 tpm=100000 weight=2\n"
        f"{ADMIN_KEY} admin rpm=1000\n"
        f"{USER_KEY}\n"
    )
    policy = AccessPolicy(keys)
    acme = policy.authenticate(bearer(ACME_KEY))
    assert acme.limits == KeyLimits(max_concurrent=2, rpm=60, tpm=100000)
    assert (acme.tenant_id, acme.weight) == ("acme", 2)
    assert policy.authenticate(bearer(ADMIN_KEY)).limits == KeyLimits(rpm=1000)
    user = policy.authenticate(bearer(USER_KEY))
    assert user.limits == KeyLimits() and user.limits.unlimited
    assert access.OPEN_CALLER.limits.unlimited
    assert AccessPolicy.from_settings(api_keys=[USER_KEY]).authenticate_key(USER_KEY).limits == (
        KeyLimits()
    )


@pytest.mark.parametrize(
    ("option", "maximum"),
    [
        ("max_concurrent=0", "1000000"),
        ("max_concurrent=1000001", "1000000"),
        ("rpm=-1", "1000000000"),
        ("rpm=", "1000000000"),
        ("rpm=1.5", "1000000000"),
        ("rpm=\u0661", "1000000000"),  # a digit, but not an ASCII one
        ("tpm=x", "1000000000000"),
        ("tpm=1e6", "1000000000000"),
        ("tpm=1000000000001", "1000000000000"),
    ],
)
def test_key_file_bad_limit_names_the_line_and_the_option(option: str, maximum: str) -> None:
    name = option.partition("=")[0]
    with pytest.raises(ValueError, match=f"line 2: {name} must be an integer in 1..{maximum}$"):
        parse_key_file(f"{USER_KEY}\n{ACME_KEY} {option}\n")


@pytest.mark.parametrize("option", ["rpm", "tpm:5", "max-concurrent=2", "RPM=5"])
def test_a_misspelt_limit_is_not_an_option_and_the_key_is_not_echoed(option: str) -> None:
    with pytest.raises(ValueError, match="line 1: word 2 is not an option") as raised:
        parse_key_file(f"{ACME_KEY} {option}\n")
    assert ACME_KEY not in str(raised.value)


def test_two_limited_keys_sharing_a_key_id_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(access, "digest_id", lambda digest: "samesame")
    # Without limits a shared key_id only blurs the logs.
    AccessPolicy(parse_key_file(f"{USER_KEY}\n{ACME_KEY}\n"))
    AccessPolicy(parse_key_file(f"{USER_KEY} rpm=5\n{ACME_KEY}\n"))
    with pytest.raises(ValueError, match="two API keys with limits share a key_id") as raised:
        AccessPolicy(parse_key_file(f"{USER_KEY} rpm=5\n{ACME_KEY} tpm=9\n"))
    assert USER_KEY not in str(raised.value) and ACME_KEY not in str(raised.value)
