"""The compose file is checked without a Docker engine: structure, every container command
parses with the same `llmserve` CLI the tests run, secrets are required and travel by
environment, and the Redis service's password recipe runs against a local redis-server."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from services.cli import build_parser  # noqa: E402
from tests.redis_server import redis_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("LLMSERVE_INTERNAL_SECRET", "LLMSERVE_REDIS_PASSWORD")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's substitution, the forms this file uses: ${VAR}, ${VAR:?error}, and $$ for a
    literal $ (left for the container's shell)."""

    def value(match: re.Match[str]) -> str:
        name, required = match.group(1), match.group(2)
        if required is not None and not env.get(name):
            raise KeyError(f"compose refuses to start: {required}")
        return env.get(name, "")

    parts = text.split("$$")
    return "$".join(re.sub(r"\$\{(\w+)(?::\?([^}]*))?\}", value, part) for part in parts)


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_present(compose: dict) -> None:  # type: ignore[type-arg]
    assert {"redis", "tokenizer", "scheduler", "worker"} <= set(compose["services"])


def test_redis_is_internal_only(compose: dict) -> None:  # type: ignore[type-arg]
    redis = compose["services"]["redis"]
    assert "ports" not in redis
    assert redis["networks"] == ["internal"]
    assert compose["networks"]["internal"]["internal"] is True
    for name, service in compose["services"].items():
        if name.startswith(("worker", "scheduler")):
            assert "ports" not in service, name


def test_tokenizers_route_over_every_scheduler_with_redis(compose: dict) -> None:  # type: ignore[type-arg]
    services = compose["services"]
    parser = build_parser()
    tokenizer = parser.parse_args(services["tokenizer"]["command"])
    schedulers = [name for name in services if name.startswith("scheduler")]
    assert len(schedulers) >= 2
    listed = {address.split(":")[0] for address in tokenizer.scheduler.split(",")}
    assert listed == set(schedulers)
    env = {"LLMSERVE_REDIS_PASSWORD": "pw"}
    redis_url = "redis://:pw@redis:6379"
    assert interpolate(services["tokenizer"]["environment"]["LLMSERVE_REDIS_URL"], env) == (
        redis_url
    )
    ids = set()
    for name in schedulers:
        args = parser.parse_args(services[name]["command"])
        assert interpolate(services[name]["environment"]["LLMSERVE_REDIS_URL"], env) == redis_url
        worker = args.worker.split(":")[0]
        assert worker in services and services[name]["depends_on"][worker]
        ids.add(args.scheduler_id)
    assert len(ids) == len(schedulers)  # the prefix index is keyed by scheduler id


def test_tokenizer_scales(compose: dict) -> None:  # type: ignore[type-arg]
    tokenizer = compose["services"]["tokenizer"]
    assert "container_name" not in tokenizer
    # A fixed host port would make `--scale tokenizer=3` fail on the second replica.
    for port in tokenizer.get("ports", []):
        assert ":" not in str(port), f"fixed host port {port!r} prevents scaling"


def test_commands_are_llmserve_commands(compose: dict) -> None:  # type: ignore[type-arg]
    parser = build_parser()
    for name, service in compose["services"].items():
        if name == "redis":
            continue
        args = parser.parse_args(service["command"])
        assert args.command == name.removesuffix("-gpu").removesuffix("-1")


def test_dependencies_wait_for_health(compose: dict) -> None:  # type: ignore[type-arg]
    services = compose["services"]
    assert services["scheduler"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert services["tokenizer"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    for name in ("worker", "scheduler", "tokenizer"):
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.healthcheck"]


def test_dockerfile_entrypoint_is_llmserve() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["llmserve"]' in dockerfile
    assert "torch==2.13.0" in dockerfile


def test_secrets_are_required_and_never_on_a_command_line(compose: dict) -> None:  # type: ignore[type-arg]
    for name, service in compose["services"].items():
        command = " ".join(service["command"])
        assert "--redis-url" not in command and "--internal-secret" not in command, name
        assert "--requirepass" not in command, name
        environment = service["environment"]
        if name == "redis":
            assert "LLMSERVE_INTERNAL_SECRET" not in environment
            continue
        # Every internal call carries the stack's secret; compose will not start without it.
        with pytest.raises(KeyError, match="LLMSERVE_INTERNAL_SECRET"):
            interpolate(environment["LLMSERVE_INTERNAL_SECRET"], {})
        assert interpolate(environment["LLMSERVE_INTERNAL_SECRET"], {SECRETS[0]: "s"}) == "s"
        if "LLMSERVE_REDIS_URL" in environment:
            with pytest.raises(KeyError, match="LLMSERVE_REDIS_PASSWORD"):
                interpolate(environment["LLMSERVE_REDIS_URL"], {})
    with pytest.raises(KeyError, match="LLMSERVE_REDIS_PASSWORD"):
        interpolate(compose["services"]["redis"]["environment"]["LLMSERVE_REDIS_PASSWORD"], {})


def test_internal_ports_listen_on_every_interface_only_in_containers(compose: dict) -> None:  # type: ignore[type-arg]
    # The services default to loopback; inside a container that would refuse the network.
    parser = build_parser()
    for name, service in compose["services"].items():
        if name != "redis":
            assert parser.parse_args(service["command"]).host == "0.0.0.0", name


def redis_ping(port: int, password: str | None) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        if password is not None:
            sock.sendall(f"AUTH {password}\r\n".encode())
            assert sock.recv(64).startswith(b"+OK")
        sock.sendall(b"PING\r\n")
        return sock.recv(64)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_redis_recipe_requires_the_password_and_hides_it(compose: dict) -> None:  # type: ignore[type-arg]
    """The redis service's command and health check, run here as the container's shell would
    (on loopback and a free port instead of the container's 6379)."""
    redis = compose["services"]["redis"]
    password = "compose-pw-41f7"
    env = {**os.environ, "LLMSERVE_REDIS_PASSWORD": password}
    shell, flag, script = (interpolate(part, env) for part in redis["command"])
    assert (shell, flag) == ("sh", "-c")
    with redis_recipe(script, env) as (process, port):
        assert redis_ping(port, password).startswith(b"+PONG")
        # exec: the shell became redis-server, whose command line has no password.
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and password.encode() not in cmdline
        check = interpolate(redis["healthcheck"]["test"][1], env)
        check = check.replace("redis-cli ping", f"redis-cli -p {port} ping")
        assert subprocess.run(["sh", "-c", check], env=env, timeout=10).returncode == 0
        wrong = {**env, "LLMSERVE_REDIS_PASSWORD": "wrong"}
        assert subprocess.run(["sh", "-c", check], env=wrong, timeout=10).returncode != 0


def test_the_disaggregated_override_gives_each_pair_a_role(
    compose: dict,  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docker-compose.disagg.yml: one prefill and one decode scheduler, each role read by the
    scheduler's own config from its environment; the decode pair's worker listens where the
    prefill worker can push its KV (the decode scheduler's --worker, on the internal network)."""
    import argparse

    from services.common.config_flags import add_config_flags, config_from_args
    from services.scheduler.server_config import SchedulerServerConfig

    override = yaml.safe_load((ROOT / "docker-compose.disagg.yml").read_text())
    services = compose["services"]
    roles: dict[str, str] = {}
    parser = build_parser()
    for name, service in override["services"].items():
        assert name in services, name
        assert set(service) == {"environment"}  # merged into the service, nothing replaced
        monkeypatch.setenv("LLMSERVE_ROLE", service["environment"]["LLMSERVE_ROLE"])
        flags = argparse.ArgumentParser()
        add_config_flags(flags, SchedulerServerConfig)
        roles[name] = config_from_args(SchedulerServerConfig, flags.parse_args([])).role
        if roles[name] == "decode":
            worker = parser.parse_args(services[name]["command"]).worker.split(":")[0]
            worker_args = parser.parse_args(services[worker]["command"])
            assert worker_args.host == "0.0.0.0"
            assert services[worker]["networks"] == ["internal"]
    assert sorted(roles.values()) == ["decode", "prefill"]
