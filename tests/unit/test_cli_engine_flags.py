"""The `offline` and `demo` commands' engine flags come from EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from services.engine.commands import add_engine_flags, engine_config
from services.engine.config import EngineConfig
from services.worker.config import GiB


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = engine_config(parser.parse_args(argv))
    assert isinstance(config, EngineConfig)
    return config


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KV_CACHE_BYTES", "NUM_THREADS", "ENABLE_PREFIX_CACHING", "DTYPE"):
        monkeypatch.delenv(f"LLMSERVE_{name}", raising=False)


def test_defaults_are_the_configs() -> None:
    assert parse([]) == EngineConfig()


def test_field_flags() -> None:
    config = parse(["--kv-cache-gib", "0.5", "--threads", "3", "--no-enable-prefix-caching"])
    assert (config.kv_cache_gib, config.threads) == (0.5, 3)
    assert not config.enable_prefix_caching


def test_older_spellings_still_work_and_say_which_to_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = parse(["--kv-cache-bytes", str(GiB // 2), "--num-threads", "2", "--no-prefix-caching"])
    assert config.kv_cache_gib == 0.5
    assert config.threads == 2
    assert not config.enable_prefix_caching
    err = capsys.readouterr().err
    for old, new in [
        ("--kv-cache-bytes", "--kv-cache-gib"),
        ("--num-threads", "--threads"),
        ("--no-prefix-caching", "--no-enable-prefix-caching"),
    ]:
        assert f"{old} is deprecated; use {new}" in err


def test_literal_fields_take_only_their_values() -> None:
    with pytest.raises(SystemExit):
        parse(["--dtype", "fp8"])
