"""--lora-modules and the LoRA flags: parsed and checked once (services/common/serving_config.py),
handed by `llmserve up` to every worker unchanged."""

from __future__ import annotations

import argparse

import pytest

from services.common.config_flags import add_config_flags, config_argv, config_from_args
from services.common.serving_config import LoraConfig
from services.worker.config import WorkerConfig


def worker_config(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, WorkerConfig)
    return config_from_args(WorkerConfig, parser.parse_args(argv))


def test_each_flag_names_one_adapter() -> None:
    config = worker_config(
        ["--lora-modules", "sql=/a/sql", "--lora-modules", "chat=/b/chat.gguf", "--max-loras", "2"]
    )
    assert config.lora_module_paths() == {"sql": "/a/sql", "chat": "/b/chat.gguf"}
    assert worker_config([]).lora_module_paths() == {}


def test_one_flag_takes_several_adapters_as_vllm_does() -> None:
    config = worker_config(
        ["--lora-modules", "sql=/a/sql", "chat=/b/chat.gguf", "--max-loras", "2"]
    )
    assert config.lora_module_paths() == {"sql": "/a/sql", "chat": "/b/chat.gguf"}
    # Both forms mix: each flag adds its values.
    mixed = worker_config(["--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"])
    assert list(mixed.lora_module_paths()) == ["a", "b", "c"]


def test_vllm_json_form_names_an_adapter() -> None:
    spec = '{"name": "sql", "path": "/a/sql", "base_model_name": "base"}'
    config = worker_config(["--lora-modules", spec, "chat=/b"])
    assert config.lora_module_paths() == {"sql": "/a/sql", "chat": "/b"}
    # The stack hands the value on as given; the child reads it the same.
    assert worker_config(config_argv(config, LoraConfig)).lora_module_paths() == {
        "sql": "/a/sql",
        "chat": "/b",
    }


def test_a_path_may_hold_an_equals_sign() -> None:
    assert worker_config(["--lora-modules", "x=/a=b"]).lora_module_paths() == {"x": "/a=b"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "no-path"], "not NAME=PATH"),
        (["--lora-modules", "=/a"], "not NAME=PATH"),
        (["--lora-modules", "a=/x", "--lora-modules", "a=/y"], "named twice"),
        (["--lora-modules", "a=/x", "--max-loras", "0"], "max_loras is 0"),
        (["--lora-modules", "a=/x", "a=/y"], "named twice"),
        (["--lora-modules", '{"name": "a", "path": "/x"}', "a=/y"], "named twice"),
        (["--lora-modules", '{"name": "a"}'], "'name' and 'path'"),
        (["--lora-modules", '{"name": "a", "path": 3}'], "'name' and 'path'"),
        (["--lora-modules", '{"name": "a",'], "not valid JSON"),
    ],
)
def test_bad_modules_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker_config(argv)


def test_the_stack_hands_the_adapters_to_its_workers() -> None:
    config = worker_config(["--lora-modules", "a=/x", "--lora-modules", "b=/y"])
    argv = config_argv(config, LoraConfig)
    assert worker_config(argv).lora_modules == ("a=/x", "b=/y")
