"""`llmserve bench serve --compare-inprocess`: the `llmserve up` stack it starts, with the same
settings as the in-process engine it is compared with, and the flags that combination allows."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

from benchmarks.process_cpu import ProcessCpu
from benchmarks.serve_compare import (
    stack_up_flags,
)
from benchmarks.serve_targets import (
    ENGINE_SEED,
    parse_target,
)

STACK_LOG_TAIL_LINES = 30


class StackStartError(RuntimeError):
    """The `llmserve up` stack to compare with did not come up."""


def compared_target(args: argparse.Namespace) -> str | None:
    """--compare-inprocess: the URL of the running stack --target names, or None."""
    return None if not args.target else parse_target(args.target[0]).url


def check_compare_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag that does not fit the run asked for."""
    if not args.compare_inprocess:
        if args.stack_arg:
            raise ValueError("--stack-arg applies to the stack --compare-inprocess starts")
        return
    if args.target and len(args.target) > 1:
        raise ValueError("--compare-inprocess takes at most one --target (a running stack)")
    target = compared_target(args)
    if target is not None and not target.startswith(("grpc://", "grpcs://")):
        raise ValueError(
            "--compare-inprocess compares the in-process engine with the stack: --target is "
            f"grpc://host:port (a running stack) or absent (one is started); got {target!r}"
        )
    if target is not None and args.stack_arg:
        raise ValueError("--stack-arg applies to a stack started here, not to --target's")
    if args.tokenizer_replicas < 1:
        raise ValueError("--tokenizer-replicas must be >= 1")


def compare_stack_flags(args: argparse.Namespace) -> list[str]:
    """`llmserve up` flags giving the stack the in-process engine's settings (engine_config),
    its sampler seed included, then --tokenizer-replicas and every --stack-arg."""
    return stack_up_flags(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        seed=ENGINE_SEED,
        tokenizer_replicas=args.tokenizer_replicas,
        extra=args.stack_arg or [],
    )


def log_tail(log: IO[bytes], num_lines: int = STACK_LOG_TAIL_LINES) -> str:
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-num_lines:])


@contextlib.contextmanager
def compared_stack(args: argparse.Namespace) -> Iterator[tuple[str, ProcessCpu | None]]:
    """The stack's grpc:// URL: --target's, or that of an `llmserve up` started here on free
    ports and stopped (SIGTERM, a bounded wait, then SIGKILL) when the block ends; with the
    latter, its processes (by pid) for the CPU-by-process table."""
    target = compared_target(args)
    if target is not None:
        yield target, None
        return
    from services.launcher import StackConfig
    from services.stack import running_stack

    flags = compare_stack_flags(args)
    # As long as `llmserve up` itself waits: a worker's first start builds the C++ kernels and
    # compiles its step graphs, minutes on 2 cores.
    startup_timeout_s = StackConfig().startup_timeout_s
    print(f"$ llmserve up {shlex.join(flags)}", flush=True)
    # The stack's processes log JSON lines on stderr: they go to an unnamed file, kept out of
    # the report, and its tail is shown when the stack fails to start or to stop cleanly.
    with tempfile.TemporaryFile() as log, contextlib.ExitStack() as running:
        try:
            stack = running.enter_context(
                running_stack(flags, startup_timeout_s=startup_timeout_s, stderr=log)
            )
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise StackStartError(f"llmserve up did not start: {exc}\n{log_tail(log)}") from exc
        try:
            yield f"grpc://{stack.public}", ProcessCpu(stack.info["pids"])
        finally:
            # Stopped before the engine loads, and timed: a slow drain delays the next system.
            stopping = time.perf_counter()
            running.close()
            print(
                f"llmserve up stopped: exit {stack.returncode} after "
                f"{time.perf_counter() - stopping:.1f} s\n",
                flush=True,
            )
            if stack.returncode != 0:
                print(log_tail(log), file=sys.stderr)
