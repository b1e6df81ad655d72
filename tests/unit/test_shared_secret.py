"""Secrets checked by digest (services/common/shared_secret.py), shared by the public API keys
and the stack's internal secret."""

from __future__ import annotations

import hashlib

import pytest

from services.common.shared_secret import SharedSecret, digest_id, find_digest, secret_digest

SECRET = "internal-7d0c5e2b-never-printed"


@pytest.mark.parametrize(
    "presented",
    [None, "", "wrong", SECRET[:-1], SECRET + "x", SECRET.upper(), f" {SECRET}"],
)
def test_only_the_exact_secret_matches(presented: str | None) -> None:
    assert not SharedSecret(SECRET).matches(presented)


def test_the_secret_matches() -> None:
    assert SharedSecret(SECRET).matches(SECRET)


@pytest.mark.parametrize("empty", ["", "   "])
def test_an_empty_secret_is_refused(empty: str) -> None:
    with pytest.raises(ValueError):
        SharedSecret(empty)


def test_repr_and_id_never_show_the_secret() -> None:
    shared = SharedSecret(SECRET)
    assert SECRET not in repr(shared) and SECRET not in shared.id
    assert shared.id == hashlib.sha256(SECRET.encode()).hexdigest()[:8]
    assert shared.id == digest_id(secret_digest(SECRET))


def test_find_digest_names_the_matching_one() -> None:
    digests = [secret_digest(s) for s in ("a", "b", "c")]
    assert find_digest("b", digests) == 1
    assert find_digest("d", digests) is None
    assert find_digest("a", []) is None
