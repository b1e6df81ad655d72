"""Secrets checked by digest, one way for every door: the public API keys
(services/tokenizer/access/keys.py) and the stack's internal secret (internal_auth.py).

A presented value is hashed (SHA-256) and compared with hmac.compare_digest against every known
digest, with no early exit: neither the time taken nor the value's length says how much of a
secret matched, nor which one. A secret is never logged; `digest_id`, a short prefix of its
digest, names it in logs (enough to tell two configured secrets apart, useless to guess one).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence


def secret_digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def digest_id(digest: bytes) -> str:
    """A name for the secret behind `digest` that is safe to log."""
    return digest.hex()[:8]


def find_digest(presented: str, digests: Sequence[bytes]) -> int | None:
    """The index of the digest `presented` hashes to, None when none does. Every digest is
    compared, whichever matches: constant time in which one (and whether one) matched."""
    presented_digest = secret_digest(presented)
    found: int | None = None
    for index, digest in enumerate(digests):
        if hmac.compare_digest(presented_digest, digest):
            found = index
    return found


class SharedSecret:
    """One secret that every party of a group holds (the stack's internal secret); only its
    digest is kept, and its repr shows the digest id, never the value."""

    __slots__ = ("_digest",)

    def __init__(self, secret: str) -> None:
        if not secret.strip():
            raise ValueError("a shared secret must not be empty")
        self._digest = secret_digest(secret)

    @property
    def id(self) -> str:
        return digest_id(self._digest)

    def matches(self, presented: str | None) -> bool:
        if presented is None:
            return False
        return find_digest(presented, (self._digest,)) is not None

    def __repr__(self) -> str:
        return f"SharedSecret(id={self.id})"
