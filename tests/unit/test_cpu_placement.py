"""CPU placement: what each policy gives each kind of process, and that apply() really
places a live process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.cpu_placement import (
    AUTO_POLICY,
    BACKGROUND_NICENESS,
    Placement,
    apply,
    placement_for,
    usable_cpus,
)

FOUR = (0, 1, 2, 3)


def test_none_leaves_everything_to_the_os() -> None:
    for kind in ("worker", "scheduler", "tokenizer", "redis"):
        assert placement_for("none", kind, cpus=FOUR) == Placement()


def test_nice_lowers_everything_but_the_worker() -> None:
    assert placement_for("nice", "worker", cpus=FOUR) == Placement()
    for kind in ("scheduler", "tokenizer", "redis"):
        assert placement_for("nice", kind, cpus=FOUR) == Placement(niceness=BACKGROUND_NICENESS)


def test_auto_is_the_documented_policy() -> None:
    for kind in ("worker", "scheduler"):
        assert placement_for("auto", kind, cpus=FOUR) == placement_for(AUTO_POLICY, kind, cpus=FOUR)


def test_split_keeps_the_last_core_for_everything_else() -> None:
    assert placement_for("split", "worker", cpus=FOUR) == Placement(cpus=(0, 1, 2), threads=3)
    assert placement_for("split", "tokenizer", cpus=FOUR) == Placement(cpus=(3,))
    two = [
        placement_for("split", "worker", cpus=FOUR, worker_index=i, num_workers=3)
        for i in (0, 1, 2)
    ]
    assert [p.cpus for p in two] == [(0,), (1,), (2,)]
    # More workers than cores: they share, each with one thread.
    many = placement_for("split", "worker", cpus=(0, 1), worker_index=3, num_workers=4)
    assert many == Placement(cpus=(0,), threads=1)
    assert placement_for("split", "worker", cpus=(5,)) == Placement()  # one core: no split


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="placement"):
        placement_for("fastest", "worker", cpus=FOUR)  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux scheduling calls")
def test_apply_places_a_live_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = os.getpriority(os.PRIO_PROCESS, child.pid)
        cpus = usable_cpus()[-1:]
        apply(child.pid, Placement(niceness=3, cpus=cpus))
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(before + 3, 19)
        assert tuple(os.sched_getaffinity(child.pid)) == cpus
    finally:
        child.kill()
        child.wait()
    apply(child.pid, Placement(niceness=1))  # gone: logged, not raised
