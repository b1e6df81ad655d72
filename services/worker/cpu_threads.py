"""The worker's compute threads on CPU: how many, where they run, and how they wait.

A decode step is hundreds of short parallel regions. Between regions (and between steps,
while the next plan is on its way) OpenMP threads either spin, taking a core from whatever
else runs on the machine (the scheduler and tokenizer processes on a small host), or sleep
and pay a wake-up at the next region. libgomp spins for GOMP_SPINCOUNT iterations before
sleeping; its default (300,000, a few milliseconds on this class of CPU) outlasts the gap
between two regions but also spins for milliseconds after each step, exactly when the other
processes of the stack need the cores. The launcher therefore gives workers a shorter spin
(`OPENMP_ENV`), chosen by `llmserve bench threads`-style A/B runs noted in docs/benchmarks.md.

The OpenMP runtime reads these variables once, when it starts: they must be in the
environment before torch is imported, which is why the launcher (not the worker) sets them.
"""

from __future__ import annotations

import logging
import os

import torch

from kernels import cpu_extension

log = logging.getLogger(__name__)

# Spin long enough to bridge the gaps inside a step, short enough not to outlast it.
WORKER_SPIN_COUNT = "30000"


def openmp_env(num_threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a worker process with `num_threads` compute threads; variables the
    user already set win."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", str(num_threads))
    env.setdefault("GOMP_SPINCOUNT", WORKER_SPIN_COUNT)
    return env


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_compute_threads(num_threads: int | None = None) -> list[int]:
    """Pin torch's OpenMP threads one per CPU (the first `num_threads` this process may use);
    returns the CPUs pinned, or [] when the C++ kernels or the permission are missing."""
    cpus = available_cpus()
    count = min(num_threads or torch.get_num_threads(), len(cpus))
    if count < 1 or not cpu_extension.load():
        return []
    torch.set_num_threads(count)
    pinned = [cpu for cpu in cpu_extension.ops().pin_threads(cpus[:count]) if cpu >= 0]
    log.info("compute threads pinned", extra={"cpus": ",".join(map(str, pinned))})
    return pinned
