"""How error messages quote a client's strings: a short prefix, never all of it."""

from __future__ import annotations

from services.contracts.errors import QUOTED_CHARS, quoted, shortened


def test_quoted_keeps_a_short_string_whole() -> None:
    assert quoted("bot-1") == "'bot-1'"


def test_quoted_cuts_a_long_string_with_an_ellipsis_outside_the_quotes() -> None:
    text = quoted("x" * 10_000)
    assert text == repr("x" * QUOTED_CHARS) + "…"


def test_quoted_escapes_what_would_break_a_log_line() -> None:
    assert quoted("a\nb\x00") == "'a\\nb\\x00'"


def test_shortened_is_at_most_its_limit() -> None:
    assert shortened("abc", 3) == "abc"
    assert shortened("abcd", 3) == "ab…"
