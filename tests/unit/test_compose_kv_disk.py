"""The compose file gives each worker the KV disk tier on a named volume of its own (a
directory is never shared by two workers), in both network layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]


class _ComposeLoader(yaml.SafeLoader):
    """Reads compose's `!reset` tag (an override's way to clear a list) as an empty value."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def _load(name: str) -> dict:  # type: ignore[type-arg]
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_each_worker_has_its_own_kv_disk_volume() -> None:
    compose, host = _load("docker-compose.yml"), _load("docker-compose.host.yml")
    workers = {n: s for n, s in compose["services"].items() if s["command"][0] == "worker"}
    workers.pop("worker-gpu")
    volumes = []
    for name, service in workers.items():
        directory = _flag(service["command"], "--kv-disk-dir")
        (mount,) = [v for v in service["volumes"] if v.endswith(f":{directory}")]
        volumes.append(mount.split(":")[0])
        assert _flag(host["services"][name]["command"], "--kv-disk-dir") == directory
    assert len(set(volumes)) == len(workers) == 2
    assert set(volumes) <= set(compose["volumes"])
