"""Checks every Triton kernel against its torch reference on a GPU and times both.

    python scripts/gpu_kernel_check.py                # on a CUDA machine (not run in CI)
    python scripts/gpu_kernel_check.py --smoke        # tiny shapes on CPU, TRITON_INTERPRET=1
    python scripts/gpu_kernel_check.py --compile-only # no GPU: compile every kernel for sm_90

For each case it prints the largest error against the torch op, the Triton time, the time of
the torch/SDPA equivalent, and the H100 roofline bound max(bytes / 3.35 TB/s, FLOPs / peak)
(989 TFLOPS bf16 dense, 1979 TOPS int8 dense), as a table. Shapes are a 7B Llama layer
(hidden 4096, 32 heads, 32 KV heads, head_dim 128, intermediate 11008), bf16, context 1024.
--smoke only proves the script runs: tiny shapes, no timing claims. --compile-only calls each
Triton wrapper at the 7B shapes with every `_*_kernel` replaced by a recorder that compiles the
launch for an H100 (sm_90, through the ptxas shipped in the triton wheel) instead of running
it: it catches what the interpreter cannot (typing of loop-carried values, shared-memory
limits, unsupported ops) on a machine with no GPU.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

H100_BYTES_PER_S = 3.35e12
H100_BF16_FLOPS = 989e12
H100_INT8_OPS = 1979e12


@dataclass(frozen=True, slots=True)
class ModelDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


LLAMA_7B = ModelDims(4096, 32, 32, 128, 11008, 32000)
TINY = ModelDims(128, 4, 2, 64, 256, 1000)


@dataclass(slots=True)
class Case:
    name: str
    shape: str
    triton_fn: Callable[[], object]
    torch_fn: Callable[[], object]
    compare: Callable[[], float]  # largest abs error, triton vs torch
    bytes_moved: float
    flops: float
    peak_flops: float = H100_BF16_FLOPS

    @property
    def roofline_ms(self) -> float:
        return max(self.bytes_moved / H100_BYTES_PER_S, self.flops / self.peak_flops) * 1e3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    mode.add_argument("--compile-only", action="store_true", help="compile for --arch, no GPU")
    parser.add_argument("--arch", type=int, default=90, help="CUDA capability for --compile-only")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    elif args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    import torch

    if args.compile_only:
        compile_all(args, torch)
        return
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke or --compile-only")
    if args.smoke:
        cases = build_cases(torch, "cpu", torch.float16, TINY, [1, 3], 40, 24)
    else:
        cases = build_cases(
            torch, "cuda", torch.bfloat16, LLAMA_7B, args.batches, args.context, 512
        )
    timer = make_timer(args.smoke)
    header = (
        f"{'kernel':28} {'shape':34} {'max err':>9} {'triton ms':>10} {'torch ms':>10} "
        f"{'roofline ms':>11} {'% of roof':>9}"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        err = case.compare()
        t_triton = timer(case.triton_fn)
        t_torch = timer(case.torch_fn)
        print(
            f"{case.name:28} {case.shape:34} {err:9.2e} {t_triton:10.4f} {t_torch:10.4f} "
            f"{case.roofline_ms:11.4f} {100 * case.roofline_ms / t_triton:8.1f}%",
            flush=True,
        )


def compile_all(args: argparse.Namespace, torch) -> None:  # type: ignore[no-untyped-def]
    """Runs every Triton wrapper once on CPU tensors with its kernels swapped for compilers."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    type_names = {
        torch.float32: "fp32",
        torch.float16: "fp16",
        torch.bfloat16: "bf16",
        torch.int8: "i8",
        torch.uint8: "u8",
        torch.int32: "i32",
        torch.int64: "i64",
    }
    target = GPUTarget("cuda", args.arch, 32)

    class CompileInsteadOfLaunch:
        def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
            self.fn = fn

        def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
            def launch(*call_args: object, **kwargs: object) -> None:
                bound = dict(zip(self.fn.arg_names, call_args, strict=False)) | kwargs
                signature: dict[str, str] = {}
                constexprs: dict[str, object] = {}
                for param in self.fn.params:
                    value = bound[param.name]
                    if param.is_constexpr:
                        signature[param.name] = "constexpr"
                        constexprs[param.name] = value
                    elif isinstance(value, torch.Tensor):
                        signature[param.name] = "*" + type_names[value.dtype]
                    elif isinstance(value, bool):
                        signature[param.name] = "i1"
                    elif isinstance(value, int):
                        signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                    else:
                        signature[param.name] = "fp32"
                start = time.perf_counter()
                compiled = triton.compile(ASTSource(self.fn, signature, constexprs), target=target)
                print(
                    f"{self.fn.__name__:28} sm_{args.arch}  {time.perf_counter() - start:5.1f} s"
                    f"  shared memory {compiled.metadata.shared:6d} B  grid {grid}",
                    flush=True,
                )

            return launch

    for name in (
        "triton_activation",
        "triton_decode_attention",
        "triton_kv_cache",
        "triton_lora",
        "triton_norm",
        "triton_prefill_attention",
        "triton_quant_gemm",
        "triton_rotary",
    ):
        module = importlib.import_module(f"kernels.{name}")
        for attr in dir(module):
            if attr.startswith("_") and attr.endswith("_kernel"):
                setattr(module, attr, CompileInsteadOfLaunch(getattr(module, attr)))
    for case in build_cases(torch, "cpu", torch.bfloat16, LLAMA_7B, [1], 1024, 512):
        print(f"-- {case.name} {case.shape}")
        case.triton_fn()


def make_timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    if smoke:

        def wall_ms(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return wall_ms
    import triton.testing

    return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=50))


def build_cases(  # type: ignore[no-untyped-def]
    torch,
    device: str,
    dtype,
    dims: ModelDims,
    batches: list[int],
    context: int,
    new_len: int,
) -> list[Case]:
    from kernels import (
        activation_torch,
        attention_torch,
        kv_cache_torch,
        lora_torch,
        norm_torch,
        quant_gemm_torch,
        rotary_torch,
        triton_activation,
        triton_decode_attention,
        triton_kv_cache,
        triton_lora,
        triton_norm,
        triton_prefill_attention,
        triton_quant_gemm,
        triton_rotary,
    )

    hidden, heads, kv_heads, head_dim = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim
    inter = dims.intermediate
    block_size = 16
    elt = 2  # bytes per bf16/fp16 element
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dt)

    def max_err(a: object, b: object) -> float:
        if isinstance(a, tuple):
            return max(max_err(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
        return float((a.float() - b.float()).abs().max())  # type: ignore[union-attr]

    def paired(fa: Callable[[], object], fb: Callable[[], object]) -> Callable[[], float]:
        return lambda: max_err(fa(), fb())

    cases: list[Case] = []
    scale = 1 / math.sqrt(head_dim)
    for batch in batches:
        # --- paged decode attention, bf16 and int8 KV ----------------------------------------
        blocks_per_seq = math.ceil(context / block_size)
        num_blocks = batch * blocks_per_seq + 1
        k_cache = randn(num_blocks, block_size, kv_heads, head_dim)
        v_cache = randn(num_blocks, block_size, kv_heads, head_dim)
        perm = torch.randperm(num_blocks - 1, generator=g, device=device)
        block_tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
        context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        query = randn(batch, heads, head_dim)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * elt
        attn_flops = 4 * batch * heads * context * head_dim
        decode_args = (query, k_cache, v_cache, block_tables, context_lens, scale)
        cases.append(
            Case(
                "paged_decode_attention",
                f"B={batch} ctx={context} {str(dtype).removeprefix('torch.')}",
                lambda a=decode_args: triton_decode_attention.paged_decode_attention(*a),
                lambda a=decode_args: attention_torch.paged_decode_attention(*a),
                paired(
                    lambda a=decode_args: triton_decode_attention.paged_decode_attention(*a),
                    lambda a=decode_args: attention_torch.paged_decode_attention(*a),
                ),
                kv_bytes + 2 * query.numel() * elt,
                attn_flops,
            )
        )
        k_q, k_s = kv_cache_torch.quantize_kv_int8(k_cache)
        v_q, v_s = kv_cache_torch.quantize_kv_int8(v_cache)
        int8_args = (query, k_q, v_q, block_tables, context_lens, scale, k_s, v_s)
        cases.append(
            Case(
                "paged_decode_attention",
                f"B={batch} ctx={context} int8 KV",
                lambda a=int8_args: triton_decode_attention.paged_decode_attention(*a),
                lambda a=int8_args: attention_torch.paged_decode_attention(*a),
                paired(
                    lambda a=int8_args: triton_decode_attention.paged_decode_attention(*a),
                    lambda a=int8_args: attention_torch.paged_decode_attention(*a),
                ),
                kv_bytes * (1 + 2 / 8) / elt + 2 * query.numel() * elt,
                attn_flops,
            )
        )
        # Gemma 2's attention: a 256-token window (only its blocks are read), logits capped.
        gemma = {"sliding_window": 256, "logit_softcap": 50.0}
        window_fraction = min(context, 256) / context
        window_triton = functools.partial(
            triton_decode_attention.paged_decode_attention, *decode_args, **gemma
        )
        window_torch = functools.partial(
            attention_torch.paged_decode_attention, *decode_args, **gemma
        )
        cases.append(
            Case(
                "paged_decode_attention",
                f"B={batch} ctx={context} window 256 cap 50",
                window_triton,
                window_torch,
                paired(window_triton, window_torch),
                kv_bytes * window_fraction + 2 * query.numel() * elt,
                attn_flops * window_fraction,
            )
        )

        # --- per-token elementwise ops of one layer ----------------------------------------
        key, value = randn(batch, kv_heads, head_dim), randn(batch, kv_heads, head_dim)
        slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:batch]
        kc_t, vc_t = k_cache.clone(), v_cache.clone()
        kc_r, vc_r = k_cache.clone(), v_cache.clone()

        def write_triton(key=key, value=value, kc=kc_t, vc=vc_t, slots=slots) -> object:
            triton_kv_cache.write_kv_cache(key, value, kc, vc, slots)
            return kc

        def write_torch(key=key, value=value, kc=kc_r, vc=vc_r, slots=slots) -> object:
            kv_cache_torch.write_kv_cache(key, value, kc, vc, slots)
            return kc

        cases.append(
            Case(
                "write_kv_cache",
                f"T={batch}",
                write_triton,
                write_torch,
                paired(write_triton, write_torch),
                4 * key.numel() * elt,
                0,
            )
        )
        x, residual, weight = randn(batch, hidden), randn(batch, hidden), randn(hidden)
        norm_args = (x, residual, weight, 1e-5)
        cases.append(
            Case(
                "fused_add_rms_norm",
                f"T={batch} H={hidden}",
                lambda a=norm_args: triton_norm.fused_add_rms_norm(*a),
                lambda a=norm_args: norm_torch.fused_add_rms_norm(*a),
                paired(
                    lambda a=norm_args: triton_norm.fused_add_rms_norm(*a),
                    lambda a=norm_args: norm_torch.fused_add_rms_norm(*a),
                ),
                4 * x.numel() * elt + hidden * elt,
                0,
            )
        )
        qr, kr = randn(batch, heads, head_dim), randn(batch, kv_heads, head_dim)
        angles = torch.rand(4096, head_dim // 2, generator=g, device=device) * 100
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        positions = torch.randint(0, 4096, (batch,), generator=g, device=device)
        cases.append(
            Case(
                "apply_rotary (in place)",
                f"T={batch} Hq={heads} Hkv={kv_heads}",
                lambda q=qr, k=kr, p=positions, cs=cos_sin: triton_rotary.apply_rotary(q, k, p, cs),
                lambda q=qr, k=kr, p=positions, cs=cos_sin: rotary_torch.apply_rotary(q, k, p, cs),
                # Each call rotates in place, so compare on fresh copies.
                paired(
                    lambda q=qr, k=kr, p=positions, cs=cos_sin: triton_rotary.apply_rotary(
                        q.clone(), k.clone(), p, cs
                    ),
                    lambda q=qr, k=kr, p=positions, cs=cos_sin: rotary_torch.apply_rotary(
                        q.clone(), k.clone(), p, cs
                    ),
                ),
                2 * (qr.numel() + kr.numel()) * elt + batch * head_dim * 4,
                0,
            )
        )
        gate_up = randn(batch, 2 * inter)
        cases.append(
            Case(
                "silu_and_mul",
                f"T={batch} I={inter}",
                lambda a=gate_up: triton_activation.silu_and_mul(a),
                lambda a=gate_up: activation_torch.silu_and_mul(a),
                paired(
                    lambda a=gate_up: triton_activation.silu_and_mul(a),
                    lambda a=gate_up: activation_torch.silu_and_mul(a),
                ),
                3 * batch * inter * elt,
                0,
            )
        )

        # --- quantized GEMMs (MLP up projection: K = hidden, N = intermediate) --------------
        w = randn(inter, hidden)
        xg = randn(batch, hidden)
        w_q, w_scale = quant_gemm_torch.quantize_int8_rows(w)
        act_bytes = (batch * hidden + batch * inter) * elt
        cases.append(
            Case(
                "int8_gemm (W8A8)",
                f"M={batch} N={inter} K={hidden}",
                lambda a=(xg, w_q, w_scale): triton_quant_gemm.int8_gemm(*a),
                lambda a=(xg, w): torch.nn.functional.linear(*a),  # the bf16 layer it replaces
                paired(
                    lambda a=(xg, w_q, w_scale): triton_quant_gemm.int8_gemm(*a),
                    lambda a=(xg, w_q, w_scale): quant_gemm_torch.int8_gemm(*a),
                ),
                w_q.numel() + act_bytes,
                2 * batch * inter * hidden,
                H100_INT8_OPS,
            )
        )

        # --- batched multi-LoRA on q|k|v: a decode batch over 4 adapters, rank 16 ------------
        rank, num_slots = 16, 8
        qkv_slices = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        x_lora = randn(batch, hidden)
        lora_a = randn(num_slots, 3 * rank, hidden)
        lora_b = randn(num_slots, sum(qkv_slices), rank)
        y_base = randn(batch, sum(qkv_slices))
        seg_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        seg_slots = (torch.arange(batch, device=device) % 4).int()
        lora_scales = torch.full((num_slots,), 0.5, device=device)
        lora_args = (x_lora, lora_a, lora_b, seg_starts, seg_slots, lora_scales)

        def lora_triton(y_base=y_base, args=lora_args, out_slices=qkv_slices):  # type: ignore[no-untyped-def]
            x, a, b, starts, slots, scales = args
            y = y_base.clone()
            v = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
            triton_lora.lora_shrink(x, a, starts, slots, v, max_segment_len=1)
            triton_lora.lora_expand(v, b, starts, slots, scales, y, out_slices, max_segment_len=1)
            return y

        def lora_reference(y_base=y_base, args=lora_args, out_slices=qkv_slices):  # type: ignore[no-untyped-def]
            y = y_base.clone()
            lora_torch.lora_apply(*args, y, out_slices)
            return y

        adapters = min(batch, 4)
        cases.append(
            Case(
                "lora shrink + expand",
                f"B={batch} adapters={adapters} r={rank} q|k|v",
                lora_triton,
                lora_reference,
                paired(lora_triton, lora_reference),
                adapters * (lora_a[0].numel() + lora_b[0].numel()) * elt + 2 * y_base.numel() * elt,
                2 * batch * rank * (3 * hidden + sum(qkv_slices)),
            )
        )

    # --- prefill: 4 sequences of 512 new tokens, without and with a 512-token cached prefix --
    for prefix in (0, new_len):
        seqs = 4
        blocks_per_seq = max(1, math.ceil(prefix / block_size))
        num_blocks = seqs * blocks_per_seq + 1
        kc, vc = (randn(num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
        perm = torch.randperm(num_blocks - 1, generator=g, device=device)
        tables = perm[: seqs * blocks_per_seq].view(seqs, blocks_per_seq).int()
        total = seqs * new_len
        q, k, v = randn(total, heads, head_dim), *(randn(total, kv_heads, head_dim) for _ in "kv")
        cu = torch.arange(0, total + 1, new_len, dtype=torch.int32, device=device)
        prefix_lens = torch.full((seqs,), prefix, dtype=torch.int32, device=device)
        pre_args = (q, k, v, kc, vc, cu, prefix_lens, tables, scale)
        pairs = seqs * heads * new_len * (prefix + (new_len + 1) / 2)
        cases.append(
            Case(
                "prefill_attention",
                f"S={seqs} new={new_len} prefix={prefix}",
                lambda a=pre_args: triton_prefill_attention.prefill_attention(*a),
                lambda a=pre_args: attention_torch.prefill_attention(*a),
                paired(
                    lambda a=pre_args: triton_prefill_attention.prefill_attention(*a),
                    lambda a=pre_args: attention_torch.prefill_attention(*a),
                ),
                (2 * q.numel() + 2 * k.numel() + 2 * seqs * prefix * kv_heads * head_dim) * elt,
                4 * pairs * head_dim,
            )
        )
    # The same with a cached prefix under a 256-token window and capped logits (Gemma 2).
    gemma = {"sliding_window": 256, "logit_softcap": 50.0}
    window_triton = functools.partial(
        triton_prefill_attention.prefill_attention, *pre_args, **gemma
    )
    window_torch = functools.partial(attention_torch.prefill_attention, *pre_args, **gemma)
    cases.append(
        Case(
            "prefill_attention",
            f"S={seqs} new={new_len} prefix={prefix} window 256 cap 50",
            window_triton,
            window_torch,
            paired(window_triton, window_torch),
            (2 * q.numel() + 2 * k.numel() + 2 * seqs * min(prefix, 256) * kv_heads * head_dim)
            * elt,
            4 * seqs * heads * new_len * 256 * head_dim,
        )
    )
    return cases


if __name__ == "__main__":
    main()
