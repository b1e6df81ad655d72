"""`llmserve up --kv-disk-dir DIR`: each worker gets its own subdirectory, and only workers."""

from __future__ import annotations

import pytest

from services.launcher import StackConfig, build_children


def _flag_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == flag]


def test_each_worker_gets_its_own_pair_directory() -> None:
    stack = StackConfig(workers=3, redis=False, kv_disk_dir="/var/kv", kv_disk_gib=2.5)
    children = build_children(stack, None, None)
    workers = [c for c in children if c.kind == "worker"]
    assert [_flag_values(c.command, "--kv-disk-dir") for c in workers] == [
        ["/var/kv/pair-0"],
        ["/var/kv/pair-1"],
        ["/var/kv/pair-2"],
    ]
    assert all(_flag_values(c.command, "--kv-disk-gib") == ["2.5"] for c in workers)
    # The tier is the worker's alone: schedulers and tokenizers are not given the flags.
    others = [c for c in children if c.kind != "worker"]
    assert not any("--kv-disk-dir" in c.command or "--kv-disk-gib" in c.command for c in others)


def test_without_a_directory_no_worker_gets_one() -> None:
    children = build_children(StackConfig(workers=2, redis=False), None, None)
    assert not any("--kv-disk-dir" in c.command for c in children)


def test_the_disk_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--kv-disk-gib"):
        StackConfig(kv_disk_dir="/var/kv", kv_disk_gib=0)
