"""Where a decode step's time goes, against its floors: the in-process engine holding B
sequences at a given context, N pure-decode steps under torch.profiler, each op's own time
summed by kind.

    llmserve bench step-profile --batch-sizes 1,32 --context 256 --steps 40
    llmserve bench step-profile --batch-sizes 16 --lora-adapters 0,1,4,16

With --lora-adapters the engine holds that many random LoRA adapters (rank --lora-rank on
every linear projection) and sequence i of a batch runs with adapter i mod k (0: the base
model): one table per k, the same batch sizes, so an adapter's cost per step shows beside the
base model's.

Rows: matmuls (every linear, whatever the weight format), attention, KV-cache writes, the
other tensor ops (fused compiled loops or eager elementwise ops), sampling, and the host: the
step's wall time minus all of the above (Python, dispatch, input preparation, scheduling).
The floors are the weight bytes over the measured copy bandwidth (what a step of one
sequence cannot beat) and the matmul FLOPs over a measured matmul rate.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from time import perf_counter

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import format_table, machine_header, random_prompts
from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

# Op-name fragments -> the row they count in (first match wins; "other ops" otherwise).
KINDS: list[tuple[str, tuple[str, ...]]] = [
    (
        "matmuls",
        ("gguf_linear", "aten::mm", "aten::addmm", "aten::bmm", "int4pack", "int8pack", "_int_mm"),
    ),
    ("attention", ("paged_decode_attention", "scaled_dot_product", "prefill_attention")),
    ("KV-cache write", ("write_kv_cache", "write_cache", "index_copy")),
    ("sampling", ("argmax", "topk", "softmax", "multinomial", "sort")),
]
HEADERS = ["batch", "part", "ms / step", "share"]


def kind_of(op_name: str) -> str:
    for kind, fragments in KINDS:
        if any(fragment in op_name for fragment in fragments):
            return kind
    return "other ops"


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads from weights: every parameter and buffer of the layers and
    the output layer (the embedding reads only B rows)."""
    model = engine.model
    seen: set[int] = set()
    total = 0
    for module in [*model.layers, model.lm_head]:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total


def matmul_flops(engine: LLMEngine, batch: int) -> float:
    config = engine.model.architecture
    per_layer = config.hidden_size * (
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        + config.num_heads * config.head_dim
        + 3 * config.intermediate_size
    )
    return 2.0 * batch * (config.num_layers * per_layer + config.hidden_size * config.vocab_size)


def bandwidth_gb_s() -> float:
    """Copy bandwidth of this machine (read + write), measured on 256 MiB."""
    source = torch.ones(64 << 20, dtype=torch.float32)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = perf_counter()
        target.copy_(source)
        best = min(best, perf_counter() - start)
    return 2 * source.numel() * 4 / best / 1e9


def profile_batch(
    engine: LLMEngine, batch: int, context: int, steps: int, num_adapters: int = 0
) -> list[list[object]]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
    for index, prompt in enumerate(random_prompts(batch, context, seed=batch)):
        lora_name = f"adapter-{index % num_adapters}" if num_adapters else ""
        engine.add_request(prompt, sampling, lora_name=lora_name)
    # Until every sequence has its first token (and a couple of warm steps after).
    while engine.get_stats().num_waiting or any(
        seq.num_computed_tokens < context for seq in engine.runner.batch.sequences.values()
    ):
        engine.step()
    for _ in range(2):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (perf_counter() - start) * 1e3 / steps
    while engine.has_unfinished_requests():
        engine.step()
    per_kind: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    measured = sum(per_kind.values())
    parts = [(kind, per_kind.get(kind, 0.0)) for kind, _ in KINDS] + [
        ("other ops", per_kind.get("other ops", 0.0)),
        ("host (Python, dispatch, scheduling)", max(0.0, wall_ms - measured)),
    ]
    rows: list[list[object]] = [
        [batch, part, ms, f"{100 * ms / wall_ms:.0f} %"] for part, ms in parts
    ]
    rows.append([batch, "**step**", wall_ms, "100 %"])
    return rows


def decode_path(engine: LLMEngine, args: argparse.Namespace) -> str:
    if engine.runner.fused_decode is not None:
        return "fused (every layer in one C++ call)"
    return "eager" if args.enforce_eager else "compiled graphs"


def run(args: argparse.Namespace) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # Compiled loops record themselves too (otherwise their time would count as host time).
    torch._inductor.config.cpp.enable_kernel_profile = True
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter_counts = [int(k) for k in args.lora_adapters.split(",")]
    with tempfile.TemporaryDirectory(prefix="llmserve-step-profile-") as directory:
        modules = lora_modules(args, max(adapter_counts), Path(directory))
        return profile_all(args, batch_sizes, adapter_counts, modules)


def lora_modules(args: argparse.Namespace, count: int, directory: Path) -> tuple[str, ...]:
    """`count` random adapters of the model as --lora-modules values."""
    if not count:
        return ()
    from benchmarks.lora_adapters import write_random_adapter
    from services.common.model_source import resolve_model_path

    model = resolve_model_path(args.model)
    return tuple(
        f"adapter-{i}="
        f"{write_random_adapter(directory / str(i), model, rank=args.lora_rank, seed=i)}"
        for i in range(count)
    )


def profile_all(
    args: argparse.Namespace,
    batch_sizes: list[int],
    adapter_counts: list[int],
    modules: tuple[str, ...],
) -> int:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(2048, args.context),
            enforce_eager=args.enforce_eager,
            fused_decode=args.fused_decode,
            threads=args.threads,
            seed=0,
            lora_modules=modules,
            max_loras=max(1, len(modules)),
            max_cpu_loras=max(1, len(modules)),
            max_lora_rank=args.lora_rank,
        )
    )
    print(machine_header(torch.get_num_threads()))
    print(
        f"model: {engine.model_name}; dtype: {engine.dtype}; weights: "
        f"{engine.loaded.quantization}; decode steps: {decode_path(engine, args)}; "
        f"context {args.context}; {args.steps} steps\n"
    )
    for num_adapters in adapter_counts:
        rows: list[list[object]] = []
        for batch in batch_sizes:
            rows.extend(profile_batch(engine, batch, args.context, args.steps, num_adapters))
        if modules:
            print(f"LoRA adapters in the batch: {num_adapters}")
        print(format_table(HEADERS, rows) + "\n")
    gb_s = bandwidth_gb_s()
    weights = weight_bytes(engine)
    print(
        f"\nfloors: weights read per step {weights / 2**20:.0f} MiB at {gb_s:.0f} GB/s copy "
        f"bandwidth = {weights / gb_s / 1e6:.2f} ms; matmul work per step "
        + ", ".join(f"B={b}: {matmul_flops(engine, b) / 1e9:.2f} GFLOP" for b in batch_sizes)
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "step-profile",
        help="where a decode step's time goes (matmuls, attention, host) against its floors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=40, help="profiled decode steps")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--lora-adapters", default="0", help="adapters per batch, one table each (e.g. 0,4)"
    )
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fused C++ decode step where the model allows it (its ops still show apart)",
    )
    parser.set_defaults(func=run)


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser()
    add_parser(main_parser.add_subparsers(dest="command", required=True))
    parsed = main_parser.parse_args(["step-profile", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
