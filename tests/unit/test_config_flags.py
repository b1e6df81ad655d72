"""Service configs from CLI flags with LLMSERVE_* environment fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from services.common.config_flags import (
    add_config_flags,
    config_argv,
    config_from_args,
    secret_env,
)


@dataclass(frozen=True, slots=True)
class ExampleConfig:
    port: int = 50051
    """Port to listen on."""
    model: str | None = None
    """Model file."""
    watermark: float = 0.01
    """Free fraction."""
    prefix_caching: bool = True
    """Reuse cached blocks."""


def parse(argv: list[str]) -> ExampleConfig:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ExampleConfig)
    return config_from_args(ExampleConfig, parser.parse_args(argv))


def test_defaults_come_from_the_dataclass(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PORT", "MODEL", "WATERMARK", "PREFIX_CACHING"):
        monkeypatch.delenv(f"LLMSERVE_{name}", raising=False)
    assert parse([]) == ExampleConfig()


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_PORT", "6000")
    monkeypatch.setenv("LLMSERVE_WATERMARK", "0.5")
    monkeypatch.setenv("LLMSERVE_PREFIX_CACHING", "false")
    from_env = parse([])
    assert (from_env.port, from_env.watermark, from_env.prefix_caching) == (6000, 0.5, False)
    from_flags = parse(["--port", "7000", "--model", "m.gguf", "--prefix-caching"])
    assert (from_flags.port, from_flags.model, from_flags.prefix_caching) == (7000, "m.gguf", True)


def test_help_shows_field_docs_and_env_names() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ExampleConfig)
    text = parser.format_help()
    assert "Port to listen on." in text and "LLMSERVE_PORT" in text


def test_bad_value_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse(["--port", "not-a-number"])


# ---- repeatable and secret fields -----------------------------------------------------------

SECRET = "sk-do-not-print-7f3a"
OTHER_SECRET = "sk-nor-this-one-91bc"


@dataclass(frozen=True, slots=True)
class DoorConfig:
    port: int = 8000
    """Port."""
    origin: tuple[str, ...] = ()
    """An allowed origin; repeatable."""
    api_key: tuple[str, ...] = field(default=(), repr=False, metadata={"secret": True})
    """An API key; repeatable."""
    token: str | None = field(default=None, repr=False, metadata={"secret": True})
    """A single secret."""
    verbose: bool = False
    """Log more."""


DOOR_ENV = ("PORT", "ORIGIN", "API_KEY", "TOKEN", "VERBOSE")


@pytest.fixture
def door_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in DOOR_ENV:
        monkeypatch.delenv(f"LLMSERVE_{name}", raising=False)
    return monkeypatch


def door_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="door")
    add_config_flags(parser, DoorConfig)
    return parser


def parse_door(argv: list[str]) -> DoorConfig:
    return config_from_args(DoorConfig, door_parser().parse_args(argv))


def test_a_repeatable_field_collects_each_flag(door_env: pytest.MonkeyPatch) -> None:
    assert parse_door([]).origin == ()
    assert parse_door(["--origin", "a"]).origin == ("a",)
    config = parse_door(["--origin", "a", "--port", "1", "--origin", "b", "--origin", "a"])
    assert config.origin == ("a", "b", "a")  # in order, repeats kept
    assert config.port == 1


def test_a_repeatable_field_from_the_environment_is_a_comma_list(
    door_env: pytest.MonkeyPatch,
) -> None:
    door_env.setenv("LLMSERVE_ORIGIN", "a, b ,,c")
    assert parse_door([]).origin == ("a", "b", "c")
    door_env.setenv("LLMSERVE_ORIGIN", "")
    assert parse_door([]).origin == ()


def test_flags_replace_the_environment_default_rather_than_add_to_it(
    door_env: pytest.MonkeyPatch,
) -> None:
    door_env.setenv("LLMSERVE_ORIGIN", "env1,env2")
    assert parse_door(["--origin", "x"]).origin == ("x",)
    assert parse_door(["--origin", "x", "--origin", "y"]).origin == ("x", "y")


def test_a_parser_parses_twice_from_a_clean_default(door_env: pytest.MonkeyPatch) -> None:
    door_env.setenv("LLMSERVE_ORIGIN", "env1")
    parser = door_parser()
    assert parser.parse_args(["--origin", "x"]).origin == ("x",)
    assert parser.parse_args([]).origin == ("env1",)
    assert parser.parse_args(["--origin", "y"]).origin == ("y",)


def test_secrets_never_show_in_help(door_env: pytest.MonkeyPatch) -> None:
    unset = door_parser().format_help()
    assert "unset" in unset
    door_env.setenv("LLMSERVE_API_KEY", f"{SECRET},{OTHER_SECRET}")
    door_env.setenv("LLMSERVE_TOKEN", SECRET)
    door_env.setenv("LLMSERVE_ORIGIN", "https://example.test")
    text = door_parser().format_help()
    assert SECRET not in text and OTHER_SECRET not in text
    assert "sk-" not in text
    assert "default: set" in text
    # Fields that are not secret still show their value.
    assert "https://example.test" in text


def test_a_secret_given_as_a_flag_is_parsed(door_env: pytest.MonkeyPatch) -> None:
    config = parse_door(["--api-key", SECRET, "--api-key", OTHER_SECRET, "--token", SECRET])
    assert config.api_key == (SECRET, OTHER_SECRET)
    assert config.token == SECRET
    assert SECRET not in repr(config)


def test_config_argv_repeats_tuple_flags_and_leaves_secrets_out(
    door_env: pytest.MonkeyPatch,
) -> None:
    config = DoorConfig(
        port=9,
        origin=("a", "b"),
        api_key=(SECRET, OTHER_SECRET),
        token=SECRET,
        verbose=True,
    )
    argv = config_argv(config, DoorConfig)
    assert argv == ["--port", "9", "--origin", "a", "--origin", "b", "--verbose"]
    assert all(SECRET not in arg and OTHER_SECRET not in arg for arg in argv)
    # The flags and the secrets' environment rebuild the config in a child.
    for name, value in secret_env(config, DoorConfig).items():
        door_env.setenv(name, value)
    assert parse_door(argv) == config


def test_config_argv_of_an_empty_tuple_gives_no_flag(door_env: pytest.MonkeyPatch) -> None:
    assert config_argv(DoorConfig(), DoorConfig) == ["--port", "8000", "--no-verbose"]


def test_secret_env_gives_llmserve_names(door_env: pytest.MonkeyPatch) -> None:
    config = DoorConfig(origin=("a",), api_key=(SECRET, OTHER_SECRET), token=SECRET)
    assert secret_env(config, DoorConfig) == {
        "LLMSERVE_API_KEY": f"{SECRET},{OTHER_SECRET}",
        "LLMSERVE_TOKEN": SECRET,
    }
    # An unset secret is left out; an empty tuple clears the child's value.
    assert secret_env(DoorConfig(), DoorConfig) == {"LLMSERVE_API_KEY": ""}
