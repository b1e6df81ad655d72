"""`llmserve build-kernels`: build the C++ CPU kernels now (the worker would at its first
start) and say which instruction-set variant this CPU runs; `--all` builds every variant, so
an image or a shared cache serves any x86 CPU. `scripts/setup.sh` calls it, so the first
`llmserve up` after set-up compiles nothing."""

from __future__ import annotations

import argparse
import sys
import time


def run(args: argparse.Namespace) -> int:
    from kernels import cpu_extension

    start = time.perf_counter()
    if args.all:
        for variant in cpu_extension.VARIANTS:
            print(f"building the {variant.name} variant ...", file=sys.stderr)
            try:
                path = cpu_extension.build_only(variant)
            except Exception as exc:  # the compiler's own message says why
                print(f"build-kernels: the {variant.name} variant failed: {exc}")
                return 1
            print(f"{variant.name}: {path}")
    variant = cpu_extension.chosen_variant()
    print(
        f"building the C++ CPU kernels ({cpu_extension.library_name(variant)}) ...", file=sys.stderr
    )
    if not cpu_extension.load():
        print("build-kernels: the C++ kernels could not be built (see the warning above)")
        return 1
    ops = cpu_extension.ops()
    print(
        f"C++ CPU kernels ready in {time.perf_counter() - start:.1f} s: variant {variant.name},"
        f" attention {ops.cpu_kernel_isa()}, GGUF matmuls {ops.gguf_kernel_isa()}"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "build-kernels", help="build the C++ CPU kernels for this CPU now (cached)"
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="also every other instruction-set variant (for images and shared caches)",
    )
    parser.set_defaults(func=run)
