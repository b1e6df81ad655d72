"""One config tree: a setting shared by two configs has one default, and the stack hands the
shared groups to its children as flags that rebuild the same values."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

import pytest

from benchmarks.compare import PeersConfig
from services.common.config_flags import add_config_flags, config_argv, config_from_args
from services.common.serving_config import BatchingConfig, ModelConfig
from services.engine.config import EngineConfig
from services.launcher import CHILD_GROUPS, StackConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.server_config import SchedulerServerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig

CONFIGS = (
    WorkerConfig,
    SchedulerConfig,
    SchedulerServerConfig,
    TokenizerConfig,
    EngineConfig,
    StackConfig,
    PeersConfig,
)
# Names that mean a different thing in each config, so their defaults may differ.
PER_CONFIG = {
    "host",
    "port",  # each service's own port
    "drain_s",  # a worker's step stream is shorter than a client's stream
    "metrics_port",
    "redis_url",
    "max_model_len",  # the scheduler core takes the resolved length, never None
    "seed",  # PeersConfig: the benchmark prompts' seed, not the sampler's
    "threads",  # PeersConfig: the count both benchmarked engines use
}


def test_every_shared_field_has_one_default() -> None:
    defaults: dict[str, dict[object, list[str]]] = defaultdict(lambda: defaultdict(list))
    for config in CONFIGS:
        for field in dataclasses.fields(config):
            if field.name not in PER_CONFIG:
                defaults[field.name][field.default].append(config.__name__)
    disagreements = {name: dict(by) for name, by in defaults.items() if len(by) > 1}
    assert disagreements == {}


@pytest.mark.parametrize("kind", sorted(CHILD_GROUPS))
def test_stack_groups_rebuild_in_the_child(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("MODEL", "MAX_NUM_SEQS", "ENABLE_PREFIX_CACHING", "ENFORCE_EAGER", "SEED")
    for name in (*names, "CHAT_TEMPLATE"):
        monkeypatch.delenv(f"LLMSERVE_{name}", raising=False)
    child_config = {
        "worker": WorkerConfig,
        "scheduler": SchedulerServerConfig,
        "tokenizer": TokenizerConfig,
    }[kind]
    stack = StackConfig(
        model="m.gguf",
        max_num_seqs=7,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=3,
        chat_template="chat.jinja",
    )
    parser = argparse.ArgumentParser()
    add_config_flags(parser, child_config)
    argv = config_argv(stack, *CHILD_GROUPS[kind])
    child = config_from_args(child_config, parser.parse_args(argv))
    for group in CHILD_GROUPS[kind]:
        for field in dataclasses.fields(group):
            assert getattr(child, field.name) == getattr(stack, field.name), field.name


def test_group_docs_are_flag_help() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, SchedulerServerConfig)
    text = " ".join(parser.format_help().split())
    batching_doc = "Token budget of one step, shared by prefill chunks and decodes."
    assert batching_doc in text and "LLMSERVE_MAX_NUM_BATCHED_TOKENS" in text
    assert {f.name for f in dataclasses.fields(BatchingConfig)} <= {
        f.name for f in dataclasses.fields(SchedulerServerConfig)
    }
    # The tokenizer tier learns the model from the schedulers, never from a file.
    assert not {f.name for f in dataclasses.fields(ModelConfig)} & {
        f.name for f in dataclasses.fields(TokenizerConfig)
    }


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("worker", WorkerConfig),
        ("scheduler", SchedulerServerConfig),
        ("tokenizer", TokenizerConfig),
    ],
)
def test_each_service_config_is_made_of_the_groups_the_stack_hands_it(
    kind: str, config: type
) -> None:
    """The launcher's groups are the service's own: a group added to a service reaches it
    from `llmserve up` too."""
    shared = {group for groups in CHILD_GROUPS.values() for group in groups}
    assert [base for base in config.__mro__ if base in shared] == list(CHILD_GROUPS[kind])


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--no-speculation"], None), ([], "false")],
    ids=["flag", "env"],
)
def test_no_speculation_overrides_the_speculative_settings(
    argv: list[str], env: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation is unset by default (on where the worker is batch-invariant);
    --no-speculation (LLMSERVE_SPECULATION=false) turns it off whatever the --speculative-*
    flags say, and the stack hands it to its children."""
    if env is not None:
        monkeypatch.setenv("LLMSERVE_SPECULATION", env)
    parser = argparse.ArgumentParser()
    add_config_flags(parser, StackConfig)
    stack = config_from_args(StackConfig, parser.parse_args([*argv, "--speculative-ngram", "5"]))
    assert stack.speculation is False and stack.suffix_cache_tokens == 0
    monkeypatch.delenv("LLMSERVE_SPECULATION", raising=False)
    for kind, child in (("worker", WorkerConfig), ("scheduler", SchedulerServerConfig)):
        parser = argparse.ArgumentParser()
        add_config_flags(parser, child)
        argv = config_argv(stack, *CHILD_GROUPS[kind])
        rebuilt = config_from_args(child, parser.parse_args(argv))
        assert rebuilt.speculation is False and rebuilt.speculative_ngram == 5
    default = WorkerConfig()
    assert default.speculation is None and default.speculative_ngram > 0
    assert default.default_draft_limit(batch_invariant=True) == default.speculative_ngram
    assert default.default_draft_limit(batch_invariant=False) == 0
    assert default.suffix_cache_tokens == default.speculative_suffix_cache_tokens > 0
