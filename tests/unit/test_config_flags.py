"""Service configs from CLI flags with LLMSERVE_* environment fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from services.common.config_flags import add_config_flags, config_from_args


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
