"""`llmserve estimate`: the seeds' hardware table for a model (embedded GGUF, a HF config or
directory, or a built-in name) on a list of GPUs, plus the batch-1 decode ceiling of this CPU
from a measured memory bandwidth. The arithmetic is in roofline.py."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.tables import format_table
from services.estimate.catalog import DEFAULT_GPUS, KNOWN_GPUS, KNOWN_MODELS, find_gpu
from services.estimate.roofline import (
    DTYPE_BYTES,
    GB,
    Device,
    Estimate,
    ModelShape,
    decode_flops_per_token,
    estimate,
    kv_bytes_per_token,
    speed_of_light_tokens_per_s,
    weight_bytes,
)

TABLE_HEADERS = [
    "GPU",
    "mem GB",
    "GB/s",
    "TFLOPS",
    "weights GB",
    "KV B/token",
    "max requests",
    "batch",
    "compute ms",
    "memory ms",
    "bound",
    "max tok/s",
    "$/hour",
    "$/M tokens",
]


def shape_from_config(name: str, config: Any) -> ModelShape:
    """A ModelShape from a ModelArchitecture (services/worker/model/architecture.py)."""
    return ModelShape(
        name=name,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
    )


def load_model_shape(spec: str | None) -> tuple[ModelShape, str]:
    """The model's shape and where it came from: a built-in name, a config.json file, a HF
    directory or a .gguf file (None: the embedded model)."""
    from services.common.model_source import model_display_name, resolve_model_path
    from services.worker.model.families import hf_family, model_architecture

    if spec is not None and spec.lower() in KNOWN_MODELS:
        return KNOWN_MODELS[spec.lower()], "built-in shape"
    if spec is not None and Path(spec).is_file() and spec.endswith(".json"):
        hf_config = json.loads(Path(spec).read_text())
        config = hf_family(hf_config).read_hf(hf_config)
        return shape_from_config(Path(spec).resolve().parent.name, config), spec
    try:
        path = resolve_model_path(spec)
    except Exception as exc:  # ModelLoadError: say what else is accepted
        raise ValueError(f"{exc}; or a built-in name: {', '.join(KNOWN_MODELS)}") from None
    _, config = model_architecture(path)  # metadata only: no torch, no weights
    return shape_from_config(model_display_name(path), config), str(path)


def load_gpus_file(path: Path) -> list[Device]:
    """A JSON list of {"name", "memory_gb", "bandwidth_gb_s", "tflops", "usd_per_hour"?}."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty JSON list of GPUs")
    devices = []
    for index, entry in enumerate(entries):
        try:
            price = entry.get("usd_per_hour")
            device = Device(
                name=str(entry["name"]),
                memory_gb=float(entry["memory_gb"]),
                bandwidth_gb_s=float(entry["bandwidth_gb_s"]),
                tflops=float(entry["tflops"]),
                usd_per_hour=None if price is None else float(price),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"{path}: GPU {index} needs name, memory_gb, bandwidth_gb_s, tflops "
                f"(usd_per_hour optional): {exc!r}"
            ) from None
        if min(device.memory_gb, device.bandwidth_gb_s, device.tflops) <= 0:
            raise ValueError(f"{path}: GPU {device.name!r} has a non-positive figure")
        devices.append(device)
    return devices


def estimate_rows(estimates: Sequence[Estimate]) -> list[list[object]]:
    rows: list[list[object]] = []
    for e in estimates:
        device = e.device
        rows.append(
            [
                device.name,
                device.memory_gb,
                device.bandwidth_gb_s,
                device.tflops,
                e.weight_bytes / GB,
                int(e.kv_bytes_per_token),
                e.max_requests,
                e.batch,
                1e3 * e.compute_latency_s if e.batch else float("nan"),
                1e3 * e.memory_latency_s,
                e.bound,
                e.tokens_per_s,
                float("nan") if device.usd_per_hour is None else device.usd_per_hour,
                _significant(e.usd_per_million_tokens),
            ]
        )
    return rows


def _significant(value: float) -> str:
    """Three significant digits: costs span 0.004 to 40 $/M tokens across models and GPUs."""
    return "-" if value != value else f"{value:.3g}"  # NaN != NaN


def describe_model(model: ModelShape, source: str) -> str:
    heads = f"{model.num_heads} heads / {model.num_kv_heads} KV heads x {model.head_dim}"
    return (
        f"model: {model.name} ({source}): {model.num_layers} layers, hidden "
        f"{model.hidden_size}, {heads}, vocab {model.vocab_size}, "
        f"{model.num_params / 1e6:,.1f} M parameters"
    )


def cpu_lines(model: ModelShape, args: argparse.Namespace) -> list[str]:
    from services.estimate.memory_bandwidth import measure_copy_bandwidth

    result = measure_copy_bandwidth(args.cpu_buffer_mib, args.cpu_seconds)
    weights = weight_bytes(model, args.weight_dtype)
    kv_per_request = kv_bytes_per_token(model, args.kv_dtype) * args.context_len
    empty = speed_of_light_tokens_per_s(weights, result.bytes_per_s)
    full = speed_of_light_tokens_per_s(weights + kv_per_request, result.bytes_per_s)
    return [
        f"this CPU: copy bandwidth {result.bytes_per_s / GB:.1f} GB/s (read + write, best of "
        f"{result.num_copies} copies of {result.buffer_bytes >> 20} MiB, "
        f"{result.num_threads} torch threads)",
        f"speed of light, batch-1 decode with {args.weight_dtype} weights "
        f"({weights / GB:.3f} GB read per token): {empty:,.0f} tokens/s at an empty context, "
        f"{full:,.0f} tokens/s at {args.context_len} tokens of {args.kv_dtype} KV",
    ]


def run(args: argparse.Namespace) -> int:
    try:
        model, source = load_model_shape(args.model)
        devices = [find_gpu(name) for name in args.gpu or []]
        if args.gpus_file:
            devices += load_gpus_file(Path(args.gpus_file))
        if not devices:
            devices = [KNOWN_GPUS[name] for name in DEFAULT_GPUS]
        estimates = [
            estimate(
                model,
                device,
                context_len=args.context_len,
                weight_dtype=args.weight_dtype,
                kv_dtype=args.kv_dtype,
                memory_utilization=args.memory_utilization,
                max_batch=args.max_batch,
            )
            for device in devices
        ]
    except (ValueError, OSError) as exc:
        print(f"estimate: {exc}", file=sys.stderr)
        return 2
    kv_per_token = kv_bytes_per_token(model, args.kv_dtype)
    flops = decode_flops_per_token(model, args.context_len)
    print(describe_model(model, source))
    print(
        f"weights {args.weight_dtype}: {weight_bytes(model, args.weight_dtype) / GB:.3f} GB; "
        f"KV cache {args.kv_dtype}: {kv_per_token:,.0f} bytes/token, "
        f"{kv_per_token * args.context_len / GB:.3f} GB per {args.context_len}-token request; "
        f"decode {flops / 1e9:.2f} GFLOP/token at that context"
    )
    cap = f", batch capped at {args.max_batch}" if args.max_batch else ""
    print(
        f"every request at {args.context_len} tokens; {args.memory_utilization:.0%} of device "
        f"memory usable{cap}; step = max(compute, memory); prices indicative "
        f"(services/estimate/catalog.py)\n"
    )
    print(format_table(TABLE_HEADERS, estimate_rows(estimates)))
    if not args.no_cpu:
        print()
        for line in cpu_lines(model, args):
            print(line)
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="the seeds' hardware table: per GPU max requests, compute vs memory latency, "
        "tokens/s, cost; plus this CPU's decode speed of light",
        description=__doc__,
    )
    parser.add_argument(
        "--model",
        default=None,
        help="config.json, HF directory, .gguf, or one of: "
        f"{', '.join(KNOWN_MODELS)} (default: the embedded model)",
    )
    parser.add_argument(
        "--gpu",
        action="append",
        default=None,
        help=f"repeatable; one of {', '.join(d.name for d in KNOWN_GPUS.values())} "
        "(default: a common list)",
    )
    parser.add_argument(
        "--gpus-file",
        default=None,
        help='JSON list of {"name", "memory_gb", "bandwidth_gb_s", "tflops", "usd_per_hour"}',
    )
    parser.add_argument("--context-len", type=int, default=4096, help="tokens per request")
    parser.add_argument("--weight-dtype", default="bf16", choices=list(DTYPE_BYTES))
    parser.add_argument("--kv-dtype", default="bf16", choices=list(DTYPE_BYTES))
    parser.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory for weights + KV cache (vLLM's default 0.9)",
    )
    parser.add_argument(
        "--max-batch", type=int, default=None, help="cap requests per step (default: all that fit)"
    )
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU bandwidth test")
    parser.add_argument("--cpu-buffer-mib", type=int, default=256)
    parser.add_argument("--cpu-seconds", type=float, default=2.0)
    parser.set_defaults(func=run)
