"""`llmserve build-kernels`: build the C++ CPU kernels for this CPU now (the worker would at its
first start), and say which instruction-set paths they run. `scripts/setup.sh` calls it, so the
first `llmserve up` after set-up compiles nothing."""

from __future__ import annotations

import argparse
import sys
import time


def run(args: argparse.Namespace) -> int:
    from kernels import cpu_extension

    print(f"building the C++ CPU kernels ({cpu_extension.library_name()}) ...", file=sys.stderr)
    start = time.perf_counter()
    if not cpu_extension.load():
        print("build-kernels: the C++ kernels could not be built (see the warning above)")
        return 1
    ops = cpu_extension.ops()
    print(
        f"C++ CPU kernels ready in {time.perf_counter() - start:.1f} s: attention "
        f"{ops.cpu_kernel_isa()}, GGUF matmuls {ops.gguf_kernel_isa()}"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "build-kernels", help="build the C++ CPU kernels for this CPU now (cached)"
    )
    parser.set_defaults(func=run)
