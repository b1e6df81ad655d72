"""Loads the attention, KV-write, token-bitmask, argmax and LoRA kernels of kernels/csrc built other
ways than this machine's main build, and checks them against the torch references.

    python -m tests.kernels.cpu_kernel_variant scalar|avx512-emulated|avx2

Variants: `scalar` is the product's portable build (kernels/cpu_extension.py's `baseline`,
x86-64-v2: no SIMD backend compiled, the scalar kernels), `avx2` the product's AVX2 build (for
CPUs with AVX-512, where the main build never runs the AVX2 backend); both are the libraries
the product builds and caches, so a test run builds each once, shared with the other tests
that build them. `avx512-emulated` runs the AVX-512 backend on tests/kernels/avx512_emulation.h
(for CPUs without AVX-512): a test-only build, cached beside the product's by source hash.
Each runs in its own process: the library registers the same llmserve ops as the main one.
Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

from kernels import cpu_extension
from kernels.cpu_extension import SOURCE_DIR
from services.common.cache_files import locked

TESTS_DIR = Path(__file__).resolve().parent
# The product's builds that are a variant (kernels/cpu_extension.py's VARIANTS names).
PRODUCT_BUILDS = {"scalar": "baseline", "avx2": "avx2"}
# The test-only build: its sources and extra compiler flags.
EMULATED_SOURCES = [
    SOURCE_DIR / "paged_decode_attention.cpp",
    SOURCE_DIR / "write_kv_cache.cpp",
    SOURCE_DIR / "token_bitmask.cpp",
    SOURCE_DIR / "argmax_rows.cpp",
    SOURCE_DIR / "lora.cpp",
]
EMULATED_FLAGS = [
    *("-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"),
    *("-DLLMSERVE_EMULATE_AVX512", f"-I{TESTS_DIR}"),
]
# variant -> the ISA its kernels must report
VARIANTS = {"scalar": "scalar", "avx512-emulated": "avx512", "avx2": "avx2"}


def build(variant: str) -> None:
    """Load the variant's library into this process (built the first time)."""
    if variant in PRODUCT_BUILDS:
        os.environ[cpu_extension.VARIANT_ENV_VAR] = PRODUCT_BUILDS[variant]
        assert cpu_extension.load(), f"the product's {PRODUCT_BUILDS[variant]} build failed"
        return
    from torch.utils.cpp_extension import load as load_extension

    digest = hashlib.sha1(" ".join(EMULATED_FLAGS).encode())
    digest.update(str(SOURCE_DIR.resolve()).encode())  # one build per checkout, as the product's
    for path in [*EMULATED_SOURCES, *SOURCE_DIR.glob("*.h"), TESTS_DIR / "avx512_emulation.h"]:
        digest.update(path.read_bytes())
    name = f"llmserve_cpu_{variant.replace('-', '_')}_{digest.hexdigest()[:10]}"
    directory = cpu_extension.build_directory(name)  # in llmserve's cache, beside the product's
    with locked(directory / f"{name}.so"):
        load_extension(
            name=name,
            sources=[str(p) for p in EMULATED_SOURCES],
            extra_include_paths=[str(SOURCE_DIR)],
            extra_cflags=EMULATED_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


def check(variant: str) -> int:
    """Every shape family of the test_cpu_*.py files, fewer combinations; returns cases run."""
    from tests.kernels.cpu_extension_cases import (
        GQA,
        check_argmax_rows,
        check_decode,
        check_token_bitmask,
        check_write,
        make_decode_case,
        seeded,
    )

    ops = torch.ops.llmserve
    expected_isa = VARIANTS[variant]
    assert ops.cpu_kernel_isa() == expected_isa, f"built {ops.cpu_kernel_isa()}, not {expected_isa}"
    torch.set_num_threads(2)  # so long contexts take the split path
    cases = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            for num_q_heads, num_kv_heads in GQA:
                # [600]: one context of fewer token ranges than the threads can share, cut
                # by KV heads too (paged_decode_attention.cpp) where it is parallel work: with
                # 3 or 4 KV heads, except 4 x 64 query lanes (under kMinParallelWork).
                for lengths in ([1], [17, 0, 40, 16], [129, 3, 64], [600]):
                    g = seeded(variant, dtype, head_dim, num_q_heads, len(lengths))
                    case = make_decode_case(lengths, num_q_heads, num_kv_heads, head_dim, dtype, g)
                    check_decode(ops, case, dtype)
                    cases += 1
    for quant_group in (8, 16, 64):
        for dtype in (torch.float32, torch.bfloat16):
            for head_dim in (64, 128):
                g = seeded(variant, "int8", quant_group, dtype, head_dim)
                case = make_decode_case(
                    [33, 0, 1, 100], 9, 3, head_dim, dtype, g, quant_group=quant_group
                )
                check_decode(ops, case, dtype)
                cases += 1
    for dtype, quant_group in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 8)):
        g = seeded(variant, "long", dtype, quant_group)
        case = make_decode_case([2100, 7, 0], 9, 3, 64, dtype, g, quant_group=quant_group)
        check_decode(ops, case, dtype)
        cases += 1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for quant_group in (None, 8):
            for sliding_window, logit_softcap in ((7, 0.0), (0, 1.5), (40, 0.1), (700, 2.0)):
                g = seeded(variant, "window", dtype, quant_group, sliding_window)
                case = make_decode_case(
                    [2100, 129, 3, 0, 40],
                    9,
                    3,
                    64,
                    dtype,
                    g,
                    quant_group=quant_group,
                    sliding_window=sliding_window,
                    logit_softcap=logit_softcap,
                )
                check_decode(ops, case, dtype)
                cases += 1
    for case_g, block_size in enumerate((1, 5, 32)):
        case = make_decode_case(
            [70, 1, 33], 9, 3, 64, torch.float32, seeded(variant, case_g), block_size=block_size
        )
        check_decode(ops, case, torch.float32)
        cases += 1
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for dtype in floats:
        for cache_dtype in floats:
            check_write(ops, seeded(variant, "write", dtype, cache_dtype), dtype, cache_dtype, None)
            cases += 1
        for quant_group in (8, 16, 64):
            for head_dim in (64, 128):
                g = seeded(variant, "write int8", dtype, quant_group, head_dim)
                check_write(ops, g, dtype, torch.int8, quant_group, head_dim=head_dim)
                cases += 1
    check_write(ops, seeded(variant, "many"), torch.bfloat16, torch.int8, 8, num_tokens=140)
    check_token_bitmask(ops, seeded(variant, "token bitmask"))
    cases += check_argmax_rows(ops, seeded(variant, "argmax rows"))
    return cases + 2 + check_lora(ops, variant)


def check_lora(ops, variant: str) -> int:  # type: ignore[no-untyped-def]
    """The LoRA shrink / expand / apply ops against kernels/lora_torch.py; returns cases run."""
    from tests.kernels.cpu_extension_cases import seeded
    from tests.kernels.lora_cases import LAYOUTS, RANKS, check_against_reference, make_case

    def expand(v, b, starts, slots, scales, y, out_slices):  # type: ignore[no-untyped-def]
        ops.lora_expand(v, b, starts, slots, scales, y, out_slices or [])

    def apply(x, a, b, starts, slots, scales, y, out_slices):  # type: ignore[no-untyped-def]
        ops.lora_apply(x, a, b, starts, slots, scales, y, out_slices or [])

    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for ranks in RANKS:
            for layout in LAYOUTS:
                for out_slices in (None, [48, 16, 16]):
                    g = seeded(variant, "lora", dtype, ranks, layout, out_slices is None)
                    case = make_case(layout, ranks, dtype, g, out_slices=out_slices)
                    check_against_reference(case, ops.lora_shrink, expand, apply)
                    cases += 1
    g = seeded(variant, "lora tails")
    case = make_case("mixed", "r16", torch.float32, g, in_features=100, out_features=203)
    check_against_reference(case, ops.lora_shrink, expand, apply)
    return cases + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("variant", choices=sorted(VARIANTS))
    args = parser.parse_args()
    build(args.variant)
    print(f"{args.variant}: {check(args.variant)} cases match the torch references")


if __name__ == "__main__":
    main()
