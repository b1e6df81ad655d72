"""CPU decode micro-benchmark: the C++ ops (kernels/csrc) against the torch references.

    python -m benchmarks.kernels_decode_cpu [--heads 9 3] [--head-dim 64] [--repeats 10]
        [--threads N]

Prints markdown tables of ms per call (best of N, each cell capped at about a second) for
paged decode attention at B in {1, 16, 32, 64} x context in {128, 1024}, bf16 query with a
bf16 cache and with an int8 cache (fp16 scales, group 8), then the KV-cache write of one
decode step (B tokens) and of a 512-token prefill. Contexts are ragged (one sequence 5 tokens
short) and blocks shuffled, as in a served batch. Defaults: SmolLM2-135M's attention shape.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor

from kernels import attention_torch, cpu_extension, kv_cache_torch

BATCHES = (1, 16, 32, 64)
CONTEXTS = (128, 1024)
QUANT_GROUP = 8


def best_ms(fn: Callable[[], object], repeats: int, budget_s: float = 1.0) -> float:
    """Best of `repeats` calls after one warm-up, stopping early once `budget_s` is spent."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best * 1e3


def make_cache(
    num_blocks: int, args: argparse.Namespace, quantized: bool, g: torch.Generator
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    shape = (num_blocks, args.block_size, args.heads[1], args.head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    if not quantized:
        return k.bfloat16(), v.bfloat16(), None, None
    k_q, k_s = kv_cache_torch.quantize_kv_int8(k, QUANT_GROUP)
    v_q, v_s = kv_cache_torch.quantize_kv_int8(v, QUANT_GROUP)
    return k_q, v_q, k_s, v_s


def bench_attention(args: argparse.Namespace, g: torch.Generator) -> list[str]:
    num_q_heads, _ = args.heads
    d, bs = args.head_dim, args.block_size
    rows = []
    for quantized in (False, True):
        for batch in BATCHES:
            for ctx in CONTEXTS:
                per_seq = ctx // bs
                num_blocks = batch * per_seq + 1
                k, v, k_s, v_s = make_cache(num_blocks, args, quantized, g)
                perm = torch.randperm(num_blocks - 1, generator=g)[: batch * per_seq]
                tables = perm.view(batch, per_seq).int()
                lens = torch.full((batch,), ctx, dtype=torch.int32)
                lens[0] = ctx - 5
                q = torch.randn(batch, num_q_heads, d, generator=g).bfloat16()
                call = (q, k, v, tables, lens, d**-0.5, k_s, v_s)
                torch_ms = best_ms(
                    lambda c=call: attention_torch.paged_decode_attention(*c), args.repeats
                )
                cpp_ms = best_ms(
                    lambda c=call: torch.ops.llmserve.paged_decode_attention(*c), args.repeats
                )
                kv = "int8" if quantized else "bf16"
                rows.append(
                    f"| {kv} | {batch} | {ctx} | {torch_ms:.3f} | {cpp_ms:.3f} |"
                    f" {torch_ms / cpp_ms:.1f}x |"
                )
                print(rows[-1], flush=True)
    return rows


def bench_write(args: argparse.Namespace, g: torch.Generator) -> list[str]:
    num_q_heads, num_kv_heads = args.heads
    d = args.head_dim
    rows = []
    for quantized in (False, True):
        for tokens in (*BATCHES, 512):
            num_blocks = 64 + tokens // args.block_size
            k_cache, v_cache, k_s, v_s = make_cache(num_blocks, args, quantized, g)
            # key/value as views of a fused qkv output, as the model passes them.
            qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * d, generator=g).bfloat16()
            kv_size = num_kv_heads * d
            key = qkv[:, num_q_heads * d : num_q_heads * d + kv_size].view(tokens, num_kv_heads, d)
            value = qkv[:, -kv_size:].view(tokens, num_kv_heads, d)
            slots = torch.randperm(num_blocks * args.block_size, generator=g)[:tokens]
            call = (key, value, k_cache, v_cache, slots, k_s, v_s)
            torch_ms = best_ms(lambda c=call: kv_cache_torch.write_kv_cache(*c), args.repeats)
            cpp_ms = best_ms(lambda c=call: torch.ops.llmserve.write_kv_cache(*c), args.repeats)
            kv = "int8" if quantized else "bf16"
            rows.append(
                f"| {kv} | {tokens} | {torch_ms:.3f} | {cpp_ms:.3f} | {torch_ms / cpp_ms:.1f}x |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_extension.load():
        raise SystemExit("the C++ kernels did not build (see the log line above)")
    g = torch.Generator().manual_seed(0)
    hq, hkv = args.heads
    print(
        f"threads={torch.get_num_threads()} isa={torch.ops.llmserve.cpu_kernel_isa()}"
        f" Hq={hq} Hkv={hkv} D={args.head_dim} block_size={args.block_size}"
        f" query bf16, int8 KV: fp16 scales per {QUANT_GROUP} values\n"
    )
    print("| KV cache | B | context | torch ms | C++ ms | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    bench_attention(args, g)
    print("\n| KV write | tokens | torch ms | C++ ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    bench_write(args, g)


if __name__ == "__main__":
    main()
