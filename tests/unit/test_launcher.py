"""`llmserve up`'s secrets (services/launcher.py), without starting anything: every child of a
stack gets the same internal secret and the Redis URL by environment, never on its command
line; the private redis-server gets its password on stdin; each stack makes its own secrets;
and every internal port listens on loopback unless told otherwise."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from services.common import cache_files
from services.common.config_flags import add_config_flags
from services.launcher import (
    Child,
    Stack,
    StackConfig,
    build_children,
    private_redis,
    stack_redis_url,
    with_internal_secret,
)
from services.scheduler.server_config import SchedulerServerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig

SECRET = "internal-5b7e0a-not-for-argv"
PASSWORD = "redis-pw-91d3c0"
API_KEY = "sk-launcher-test-17"


@pytest.fixture(autouse=True)
def no_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("INTERNAL_SECRET", "REDIS_URL", "API_KEY"):
        monkeypatch.delenv(f"LLMSERVE_{name}", raising=False)


def fake_redis() -> Child:
    return Child("redis", "redis", ["redis-server", "-"], "127.0.0.1:6390", lambda _: True)


def children(**config: object) -> list[Child]:
    stack = StackConfig(internal_secret=SECRET, workers=2, tokenizer_replicas=2, **config)  # type: ignore[arg-type]
    redis = fake_redis()
    return build_children(stack, redis, stack_redis_url(stack, redis, PASSWORD))


def test_secrets_reach_every_child_by_environment_only() -> None:
    everything = children(api_key=(API_KEY,))
    assert [c.kind for c in everything].count("scheduler") == 2
    for child in everything[1:]:  # after the redis-server
        command = " ".join(child.command)
        for value in (SECRET, PASSWORD, API_KEY):
            assert value not in command, child.name
        assert "--redis-url" not in command and "--internal-secret" not in command
        assert child.env["LLMSERVE_INTERNAL_SECRET"] == SECRET, child.name
    for child in everything:
        url = child.env.get("LLMSERVE_REDIS_URL")
        if child.kind in ("scheduler", "tokenizer"):
            assert url == f"redis://:{PASSWORD}@127.0.0.1:6390", child.name
        else:
            assert url is None, child.name
        assert ("LLMSERVE_API_KEY" in child.env) == (child.kind == "tokenizer"), child.name


def test_no_redis_means_no_url() -> None:
    for child in children(redis=False):
        assert "LLMSERVE_REDIS_URL" not in child.env


def test_a_given_redis_url_is_passed_on_as_given_by_environment() -> None:
    given = "rediss://app:s3cret@cache.example:6380/2"
    stack = StackConfig(internal_secret=SECRET, redis_url=given)
    for child in build_children(stack, None, stack_redis_url(stack, None)):
        assert "s3cret" not in " ".join(child.command)
        if child.kind in ("scheduler", "tokenizer"):
            assert child.env["LLMSERVE_REDIS_URL"] == given


def test_each_stack_makes_its_own_internal_secret() -> None:
    first, second = with_internal_secret(StackConfig()), with_internal_secret(StackConfig())
    assert first.internal_secret and second.internal_secret
    assert first.internal_secret != second.internal_secret
    assert len(first.internal_secret) >= 32
    # One given (LLMSERVE_INTERNAL_SECRET) is kept: the operator can call the stack too.
    assert with_internal_secret(StackConfig(internal_secret=SECRET)).internal_secret == SECRET


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_private_redis_gets_its_password_on_stdin() -> None:
    redis = private_redis("127.0.0.1", PASSWORD)
    assert redis is not None
    assert PASSWORD not in " ".join(redis.command)
    assert redis.command[1] == "-"  # configuration from stdin first, then the flags
    assert redis.stdin == f"requirepass {PASSWORD}\n".encode()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_a_stack_shows_its_redis_url_without_the_password() -> None:
    stack = Stack(StackConfig())
    assert stack.redis_url is not None
    password = urlsplit(stack.redis_url).password
    assert password and len(password) >= 32
    shown = str(stack.describe()["redis_url"])
    assert password not in shown and urlsplit(shown).port == urlsplit(stack.redis_url).port
    assert stack.config.internal_secret
    assert stack.config.internal_secret not in repr(stack.config)
    assert password not in repr(stack.config)


def test_secrets_are_hidden_in_help() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, StackConfig)
    text = " ".join(parser.format_help().split())
    assert "LLMSERVE_INTERNAL_SECRET; default: unset" in text
    assert "LLMSERVE_REDIS_URL; default: unset" in text


@pytest.mark.parametrize(
    "config", [WorkerConfig, SchedulerServerConfig, TokenizerConfig, StackConfig]
)
def test_ports_listen_on_loopback_by_default(config: type) -> None:
    assert config().host == "127.0.0.1"


def test_the_ready_file_is_replaced_in_one_step(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    ready.write_text('{"pids": {"worker-0": 1}}')
    inode = ready.stat().st_ino
    cache_files.write_text(ready, '{"pids": {"worker-0": 2}}')
    # A new file renamed over the old one: a reader holds either whole, never a truncated one.
    assert ready.read_text() == '{"pids": {"worker-0": 2}}'
    assert ready.stat().st_ino != inode
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]


def test_each_tokenizer_replica_must_serve_itself_not_only_its_shared_port(
    tmp_path: Path,
) -> None:
    """Replicas share one port: a health answer there may come from a loaded sibling, so a
    replica is ready only once its own marker file exists (written when it turns SERVING)."""
    stack = StackConfig(tokenizer_replicas=2, redis=False)
    tokenizers = [
        c
        for c in build_children(stack, None, stack_redis_url(stack, None))
        if c.kind == "tokenizer"
    ]
    markers = [c.serving_marker for c in tokenizers]
    assert None not in markers and len(set(markers)) == 2
    for child in tokenizers:
        assert child.env["LLMSERVE_SERVING_MARKER"] == str(child.serving_marker)
        child.ready = lambda _address: True  # the shared port answers SERVING
    first, second = tokenizers
    assert first.serving_marker is not None
    first.serving_marker.write_text("1")
    assert first.serves() and not second.serves()
    # A restart forgets the old marker before the process starts again.
    first.command = ["true"]
    first.start({})
    assert not first.serving_marker.exists() and not first.serves()
    first.process.wait()  # type: ignore[union-attr]
    shutil.rmtree(first.serving_marker.parent)


def _flag(command: list[str], flag: str) -> str:
    """The value of the last `flag` in `command` (the last one given wins)."""
    index = max(i for i, arg in enumerate(command) if arg == flag)
    return command[index + 1]


def test_prefill_and_decode_pairs_get_their_roles_and_share_the_cores() -> None:
    stack = StackConfig(prefill_pairs=1, decode_pairs=2, redis=False, disaggregate_min_prompt=100)
    children = build_children(stack, None, None)
    schedulers = [c for c in children if c.kind == "scheduler"]
    assert [_flag(c.command, "--role") for c in schedulers] == ["prefill", "decode", "decode"]
    assert len([c for c in children if c.kind == "worker"]) == 3
    (tokenizer,) = [c for c in children if c.kind == "tokenizer"]
    assert _flag(tokenizer.command, "--disaggregate-min-prompt") == "100"
    assert _flag(tokenizer.command, "--scheduler").count(",") == 2


def test_without_roles_every_pair_serves_both_and_prefill_pairs_alone_get_a_decode_pair() -> None:
    assert StackConfig(workers=2).pair_roles == ["both", "both"]
    assert StackConfig(prefill_pairs=2).pair_roles == ["prefill", "prefill", "decode"]
    with pytest.raises(ValueError, match="prefill-pairs"):
        StackConfig(prefill_pairs=-1)
    with pytest.raises(ValueError, match="disaggregate-min-prompt"):
        StackConfig(disaggregate_min_prompt=0)


def test_internal_ports_are_picked_below_the_ephemeral_range() -> None:
    # A port from the ephemeral range could be handed to an outgoing connection before the
    # child binds it; below the range only another listener can take it.
    import socket
    from pathlib import Path

    from services.launcher import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(15000 <= port < low for port in ports)
    assert len(ports) > 1  # picked at random, not one fixed port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_without_the_ephemeral_range_the_kernel_picks_the_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import socket

    from services import launcher

    monkeypatch.setattr(launcher, "_EPHEMERAL_RANGE", tmp_path / "absent")
    port = launcher.free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
