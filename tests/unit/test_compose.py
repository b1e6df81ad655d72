"""The compose file is checked without a Docker engine: structure, and every container
command parses with the same `llmserve` CLI the tests run."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from services.cli import build_parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


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
    assert tokenizer.redis_url == "redis://redis:6379"
    ids = set()
    for name in schedulers:
        args = parser.parse_args(services[name]["command"])
        assert args.redis_url == "redis://redis:6379"
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
