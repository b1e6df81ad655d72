"""Two processes racing for the same thing: spawned (not forked: the test worker may hold
torch's threads), released together by a barrier."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROCESS_TIMEOUT_S = 120


def run_together(target: Callable[..., None], *args: Any) -> None:
    """`target(barrier, index, *args)` in two spawned processes at once (a module-level
    function, so the children can import it); both must succeed."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    processes = [context.Process(target=target, args=(barrier, i, *args)) for i in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(PROCESS_TIMEOUT_S)
    for process in processes:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0, 0]


def record_call(calls: Path, index: int) -> None:
    """One line per call in `calls` (O_APPEND: short lines from two processes never mix)."""
    with calls.open("a") as log:
        log.write(f"{index}\n")
