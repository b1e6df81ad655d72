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
    config = parse(["--kv-cache-bytes", "1000", "--num-threads", "3", "--no-enable-prefix-caching"])
    assert (config.kv_cache_bytes, config.num_threads) == (1000, 3)
    assert not config.enable_prefix_caching


def test_older_spellings_still_work() -> None:
    config = parse(["--kv-cache-gib", "0.5", "--threads", "2", "--no-prefix-caching"])
    assert config.kv_cache_bytes == GiB // 2
    assert config.num_threads == 2
    assert not config.enable_prefix_caching


def test_literal_fields_take_only_their_values() -> None:
    with pytest.raises(SystemExit):
        parse(["--dtype", "fp8"])
