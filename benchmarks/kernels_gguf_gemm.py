"""Micro-benchmark of the GGUF block kernels (kernels/csrc/gguf_gemm.cpp) on SmolLM2-135M's
shapes: ms per call against torch's CPU paths, and the sum over one decode step (30 layers'
q|k|v, o, gate|up and down, plus the lm_head).

    python -m benchmarks.kernels_gguf_gemm [--m 1 4 16 32 64] [--budget-s 0.02] [--repeats 3]

Columns: gguf fp32 (exact path), gguf bf16 (int8 activation blocks), torch packed bf16
(aten._weight_int4pack_mm_for_cpu for the Q4 layers, as `--quantization int4` runs them, and
aten._weight_int8pack_mm for the head), bf16 and fp32 F.linear on the dequantized weight
(oneDNN), W8A8 (per-token int8 activations and torch._int_mm), and the memory floor (weight
bytes / --bandwidth-gbs). Weights are random blocks of each layer's kind in the embedded
file (Q4_1 decoder, Q8_0 head): the kernels do the same work whatever the values. Methods are
interleaved and each figure is the fastest call of --repeats rounds, so a shared machine
skews ratios less than absolute times.

The per-shape table reuses one weight, which then sits in the caches; the last table runs
a whole decode step over 30 layers of distinct weights (~95 MB of blocks), so it reads them
from memory as a real step does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import time_ms
from kernels import cpu_extension, quant_gemm_torch
from kernels.gguf_blocks_torch import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GGUF_Q4_1,
    GGUF_Q8_0,
    dequantize_blocks,
)
from kernels.quant_weight_only_torch import (
    pack_int4_for_cpu,
    quantize_int4_codes,
    quantize_int8_weight,
)

NUM_LAYERS = 30


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    in_features: int
    out_features: int
    kind: int
    per_step: int
    """Calls in one decode step."""


SHAPES = (
    Shape("q|k|v", 576, 960, GGUF_Q4_1, NUM_LAYERS),
    Shape("o", 576, 576, GGUF_Q4_1, NUM_LAYERS),
    Shape("gate|up", 576, 3072, GGUF_Q4_1, NUM_LAYERS),
    Shape("down", 1536, 576, GGUF_Q4_1, NUM_LAYERS),
    Shape("lm_head", 576, 49152, GGUF_Q8_0, 1),
)
METHODS = ("gguf fp32", "gguf bf16", "torch packed bf16", "F.linear bf16", "F.linear fp32", "w8a8")


def random_blocks(shape: Shape, generator: torch.Generator) -> Tensor:
    num_blocks, size = shape.in_features // BLOCK_VALUES, BLOCK_BYTES[shape.kind]
    raw = torch.randint(
        0, 256, (shape.out_features, num_blocks, size), dtype=torch.uint8, generator=generator
    )
    scales = torch.rand(shape.out_features, num_blocks, 2, generator=generator) * 0.02
    raw[..., 0:2] = scales[..., :1].half().view(torch.uint8)
    if shape.kind == GGUF_Q4_1:
        raw[..., 2:4] = scales[..., 1:].half().view(torch.uint8)
    return raw.view(shape.out_features, -1).contiguous()


def calls(shape: Shape, m: int, generator: torch.Generator) -> dict[str, Callable[[], Tensor]]:
    """One zero-argument call per method, all computing x [m, K] @ W^T for the same W."""
    ops = cpu_extension.ops()
    blocks = random_blocks(shape, generator)
    weight = dequantize_blocks(blocks, shape.kind)
    x = torch.randn(m, shape.in_features, generator=generator)
    x16 = x.bfloat16()
    weight16 = weight.bfloat16()
    w_q, w_scale = quantize_int8_weight(weight)
    if shape.kind == GGUF_Q8_0:
        scale16 = w_scale.bfloat16()

        def packed() -> Tensor:
            return torch.ops.aten._weight_int8pack_mm(x16, w_q, scale16)
    else:
        codes, scale, zero = quantize_int4_codes(weight, BLOCK_VALUES)
        int4, scales_and_zeros = pack_int4_for_cpu(codes, scale, zero, torch.bfloat16)

        def packed() -> Tensor:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x16, int4, BLOCK_VALUES, scales_and_zeros
            )

    return {
        "gguf fp32": lambda: ops.gguf_linear(x, blocks, shape.kind),
        "gguf bf16": lambda: ops.gguf_linear(x16, blocks, shape.kind),
        "torch packed bf16": packed,
        "F.linear bf16": lambda: F.linear(x16, weight16),
        "F.linear fp32": lambda: F.linear(x, weight),
        "w8a8": lambda: quant_gemm_torch.int8_gemm(x16, w_q, w_scale),
    }


def measure(
    ms: list[int], budget_s: float, repeats: int
) -> dict[tuple[str, int], dict[str, float]]:
    """(shape name, M) -> method -> best ms per call."""
    generator = torch.Generator().manual_seed(0)
    results: dict[tuple[str, int], dict[str, float]] = {}
    for shape in SHAPES:
        for m in ms:
            fns = calls(shape, m, generator)
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(repeats):
                for name, fn in fns.items():
                    best[name] = min(best[name], time_ms(fn, budget_s))
            results[shape.name, m] = best
    return results


def measure_step(ms: list[int], budget_s: float, repeats: int) -> dict[int, dict[str, float]]:
    """M -> method -> ms for one decode step with distinct weights in every layer."""
    generator = torch.Generator().manual_seed(1)
    methods = METHODS[:-1]  # W8A8 takes seconds per step at these sizes on CPUs without VNNI
    results: dict[int, dict[str, float]] = {}
    for m in ms:
        layers = [calls(shape, m, generator) for shape in SHAPES for _ in range(shape.per_step)]
        best = dict.fromkeys(methods, float("inf"))
        for _ in range(repeats):
            for name in methods:
                step = [layer[name] for layer in layers]
                best[name] = min(
                    best[name], time_ms(lambda step=step: [f() for f in step][-1], budget_s)
                )
        results[m] = best
        del layers
    return results


def read_bandwidth_gbs(megabytes: int = 256) -> float:
    """What one torch reduction streams from memory here: the floor's yardstick on this
    machine (the table's floor column uses --bandwidth-gbs)."""
    data = torch.ones(megabytes << 17, dtype=torch.int64)
    return megabytes * 1.048576 / time_ms(data.sum, 0.2)


def weight_bytes(shape: Shape) -> int:
    return shape.out_features * shape.in_features // BLOCK_VALUES * BLOCK_BYTES[shape.kind]


def render(
    results: dict[tuple[str, int], dict[str, float]], ms: list[int], bandwidth_gbs: float
) -> str:
    header = "| shape (K x N, kind) | M | " + " | ".join(METHODS) + " | floor |"
    lines = [header, "|" + "---|" * (len(METHODS) + 3)]
    kinds = {GGUF_Q4_1: "Q4_1", GGUF_Q8_0: "Q8_0"}
    for shape in SHAPES:
        floor = weight_bytes(shape) / bandwidth_gbs / 1e6
        label = f"{shape.name} ({shape.in_features}x{shape.out_features}, {kinds[shape.kind]})"
        for m in ms:
            row = results[shape.name, m]
            cells = " | ".join(f"{row[name]:.3f}" for name in METHODS)
            lines.append(f"| {label} | {m} | {cells} | {floor:.3f} |")
    lines += ["", "One decode step (30 layers + lm_head), ms, and gguf bf16's speed-up:", ""]
    lines.append("| M | " + " | ".join(METHODS) + " | floor | bf16 vs F.linear bf16 |")
    lines.append("|" + "---|" * (len(METHODS) + 3))
    floor = sum(weight_bytes(s) * s.per_step for s in SHAPES) / bandwidth_gbs / 1e6
    for m in ms:
        total = {
            name: sum(results[s.name, m][name] * s.per_step for s in SHAPES) for name in METHODS
        }
        cells = " | ".join(f"{total[name]:.2f}" for name in METHODS)
        ratio = total["F.linear bf16"] / total["gguf bf16"]
        lines.append(f"| {m} | {cells} | {floor:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def render_step(results: dict[int, dict[str, float]], bandwidth_gbs: float) -> str:
    methods = list(next(iter(results.values())))
    floor = sum(weight_bytes(s) * s.per_step for s in SHAPES) / bandwidth_gbs / 1e6
    lines = [
        "One decode step over distinct weights (read from memory), ms:",
        "",
        "| M | " + " | ".join(methods) + " | floor |",
        "|" + "---|" * (len(methods) + 2),
    ]
    for m, row in results.items():
        cells = " | ".join(f"{row[name]:.2f}" for name in methods)
        lines.append(f"| {m} | {cells} | {floor:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--budget-s", type=float, default=0.02, help="seconds per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bandwidth-gbs", type=float, default=45.0, help="for the floor")
    parser.add_argument(
        "--step-m", type=int, nargs="*", default=[1, 4], help="M of the distinct-weight step"
    )
    args = parser.parse_args(argv)
    if not cpu_extension.load():
        raise SystemExit("the C++ kernels did not build here (see the log line above)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"gguf kernels: {cpu_extension.ops().gguf_kernel_isa()}, threads: "
        f"{torch.get_num_threads()}, torch CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}; ms per call, best of {args.repeats}; "
        f"floor at {args.bandwidth_gbs:.0f} GB/s (a torch sum reads {read_bandwidth_gbs():.1f}"
        " GB/s here)\n"
    )
    results = measure(args.m, args.budget_s, args.repeats)
    print(render(results, args.m, args.bandwidth_gbs))
    if args.step_m:
        print()
        step = measure_step(args.step_m, args.budget_s, args.repeats)
        print(render_step(step, args.bandwidth_gbs))


if __name__ == "__main__":
    main()
