"""Who may call the public API: API keys, admin keys, and tenants bound to keys. Pure: no
gRPC, no HTTP; each door passes the `Authorization` value it received.

    no key configured           open: every caller is an admin, the tenant is the request's
    --api-key K                 K may generate, tokenize, list models and prompts; the tenant
                                is the request's (a trusted, single-owner client)
    key file "K tenant=acme"    K acts for tenant acme only: a request naming another tenant
                                is refused, one naming none is acme's
    key file "K weight=3"       K's requests count 3 times as much as a weight-1 key's in the
                                schedulers' fair shares (services/scheduler/features/fair_share.py)
    key file "K max_concurrent=4 rpm=60 tpm=100000"
                                K's limits: requests in flight at once, requests and tokens
                                (prompt + output) per minute, counted across the replicas
                                (key_limits.py); a request over one is refused (429)
    --admin-api-key A           A may do everything, RegisterPrompt and DeletePrompt included

Keys are compared as SHA-256 digests with hmac.compare_digest against every known key (no
early exit), so the time taken says nothing about how much of a key matched; the stack's
internal secret is checked the same way (services/common/shared_secret.py). Keys are never
logged: a caller shows in logs as `key_id`, a short digest prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from services.common.shared_secret import digest_id, find_digest, secret_digest
from services.contracts.errors import PermissionDeniedError, UnauthenticatedError, quoted
from services.tokenizer.access.limits import UNLIMITED, KeyLimits
from services.tokenizer.validation import GenerateInput

BEARER = "bearer "


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller."""

    key_id: str
    """A short digest prefix of the key, safe to log ("open" when no keys are configured)."""
    tenant_id: str | None = None
    """The tenant the key is bound to; None = the request names its tenant."""
    admin: bool = False
    weight: int = 1
    """The caller's share of a busy scheduler against other tenants' (key file `weight=N`)."""
    limits: KeyLimits = UNLIMITED
    """Requests in flight, requests and tokens per minute (key file `max_concurrent=N`,
    `rpm=N`, `tpm=N`)."""


OPEN_CALLER = Caller("open", admin=True)


@dataclass(frozen=True, slots=True)
class _Key:
    digest: bytes
    caller: Caller


MAX_WEIGHT = 1000
# The largest value of each numeric option (a typo of many digits is refused, not obeyed).
_MAXIMUMS = {
    "weight": MAX_WEIGHT,
    "max_concurrent": 1_000_000,
    "rpm": 1_000_000_000,
    "tpm": 1_000_000_000_000,
}


def _key(
    key: str,
    tenant_id: str | None = None,
    admin: bool = False,
    weight: int = 1,
    limits: KeyLimits = UNLIMITED,
) -> _Key:
    key = key.strip()
    if not key:
        raise ValueError("an API key must not be empty")
    digest = secret_digest(key)
    return _Key(digest, Caller(digest_id(digest), tenant_id, admin, weight, limits))


def _positive_int(option: str, source: str, number: int) -> int:
    name, _, value = option.partition("=")
    maximum = _MAXIMUMS[name]
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= maximum:
        raise ValueError(f"{source} line {number}: {name} must be an integer in 1..{maximum}")
    return int(value)


def parse_key_file(text: str, source: str = "key file") -> list[_Key]:
    """One key per line: `KEY`, `KEY tenant=ID` or `KEY admin`, and `weight=N`,
    `max_concurrent=N`, `rpm=N`, `tpm=N`; `#` starts a comment."""
    keys: list[_Key] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *options = line.split()
        tenant_id: str | None = None
        admin = False
        numbers: dict[str, int] = {}
        for position, option in enumerate(options, 2):
            name = option.partition("=")[0]
            if option == "admin":
                admin = True
            elif name in _MAXIMUMS and "=" in option:
                numbers[name] = _positive_int(option, source, number)
            elif option.startswith("tenant=") and len(option) > len("tenant="):
                tenant_id = option.removeprefix("tenant=")
            else:
                # Not echoed: a line holding two keys would put the second in the log.
                raise ValueError(
                    f"{source} line {number}: word {position} is not an option "
                    "(expected tenant=ID, weight=N, max_concurrent=N, rpm=N, tpm=N or admin; "
                    "one key per line)"
                )
        if admin and tenant_id is not None:
            raise ValueError(f"{source} line {number}: an admin key is not bound to a tenant")
        weight = numbers.pop("weight", 1)
        limits = KeyLimits(**numbers)
        keys.append(_key(key, tenant_id, admin, weight, limits))
    return keys


class AccessPolicy:
    """The keys this replica accepts and what each may do."""

    def __init__(self, keys: Iterable[_Key] = ()) -> None:
        self._keys = tuple(keys)
        digests = [k.digest for k in self._keys]
        if len(set(digests)) != len(digests):
            raise ValueError("the same API key is configured twice")
        # Limits are counted per key_id (in Redis, across replicas): two limited keys must not
        # share one (a 32-bit digest prefix: about one chance in a thousand for 3000 keys).
        limited = [k.caller.key_id for k in self._keys if not k.caller.limits.unlimited]
        if len(set(limited)) != len(limited):
            raise ValueError(
                "two API keys with limits share a key_id (a digest prefix): make a new key "
                "for one of them"
            )

    @classmethod
    def from_settings(
        cls,
        api_keys: Iterable[str] = (),
        admin_api_keys: Iterable[str] = (),
        api_key_file: str | None = None,
    ) -> AccessPolicy:
        keys = [_key(k) for k in api_keys] + [_key(k, admin=True) for k in admin_api_keys]
        if api_key_file:
            keys += parse_key_file(Path(api_key_file).read_text(), api_key_file)
        return cls(keys)

    @property
    def open(self) -> bool:
        """No key configured: anyone who reaches the port may do anything."""
        return not self._keys

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an `Authorization: Bearer <key>` value stands for; UnauthenticatedError
        when the key is missing or unknown (the message never echoes it)."""
        if self.open:
            return OPEN_CALLER
        if not authorization:
            raise UnauthenticatedError(
                "missing API key: send it as 'Authorization: Bearer <key>' (gRPC: the "
                "'authorization' metadata)"
            )
        if authorization[: len(BEARER)].lower() != BEARER:
            raise UnauthenticatedError("the Authorization header must be 'Bearer <key>'")
        return self.authenticate_key(authorization[len(BEARER) :])

    def authenticate_key(self, presented: str) -> Caller:
        """The caller a bare key stands for (the Anthropic door's `x-api-key` header)."""
        if self.open:
            return OPEN_CALLER
        found = find_digest(presented.strip(), [key.digest for key in self._keys])
        if found is None:
            raise UnauthenticatedError("invalid API key")
        return self._keys[found].caller


def tenant_for(caller: Caller, requested: str, field: str = "tenant_id") -> str:
    """The tenant a call acts for: the key's when bound (a request may repeat it, never name
    another), else the request's."""
    if caller.tenant_id is None:
        return requested
    if requested and requested != caller.tenant_id:
        raise PermissionDeniedError(
            f"{field}: this API key may not act for tenant {quoted(requested)}"
        )
    return caller.tenant_id


def acting_for(generate_input: GenerateInput, caller: Caller) -> GenerateInput:
    """The request as the caller may send it: its tenant checked (`tenant_for`), and the
    key's weight, which a request can never set itself."""
    tenant_id = tenant_for(caller, generate_input.tenant_id)
    return replace(generate_input, tenant_id=tenant_id, tenant_weight=caller.weight)


def require_admin(caller: Caller, what: str) -> None:
    if not caller.admin:
        raise PermissionDeniedError(f"{what} needs an admin API key (--admin-api-key)")
