"""`llmserve inspect [PATH]`: what a model is and whether llmserve serves it, from its metadata
(services/model_inspect.py), as text or one JSON object; `--load` also loads it as the worker
does and reports the process's resident memory before and after.

Exit codes: 0 servable, 2 refused, 1 when the path is missing or cannot be read as a model.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.common.model_source import resolve_model_path
from services.common.serving_config import DeviceConfig
from services.contracts.errors import ModelLoadError
from services.contracts.memory_budget import MemoryBudget
from services.model_inspect import ModelReport, UnreadableModelError, describe_model

EXIT_SERVABLE = 0
EXIT_UNREADABLE = 1
EXIT_REFUSED = 2
LOAD_DTYPES = ("float32", "bfloat16", "float16")
_LIST_LIMIT = 8


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "inspect",
        help="what a model file is and whether llmserve serves it (metadata only, no weights)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path",
        nargs="?",
        default=None,
        help=".gguf file or Hugging Face directory (default: the embedded model)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--load",
        action="store_true",
        help="also load the weights as the worker does (--quantization auto) and report the"
        " process's resident memory (VmRSS) before and after",
    )
    parser.add_argument(
        "--dtype", choices=LOAD_DTYPES, default="float32", help="model dtype of --load"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=DeviceConfig.kv_cache_gib,
        help="KV cache of --load's memory budget, GiB (the worker's default)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.path is not None and not Path(args.path).expanduser().exists():
        print(f"llmserve: error: no such file or directory: {args.path}", file=sys.stderr)
        return EXIT_UNREADABLE
    try:
        path = resolve_model_path(args.path)
        report = describe_model(path)
    except (ModelLoadError, UnreadableModelError) as exc:
        print(f"llmserve: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    load = (
        measure_load(path, args.dtype, args.kv_cache_gib) if args.load and report.servable else None
    )
    if args.json:
        document = report.to_json()
        if load is not None:
            document["load"] = load
        print(json.dumps(document, indent=2))
    else:
        print(format_report(report))
        if args.load:
            print(format_load(report, load, args.dtype))
        print(report.verdict)
    return EXIT_SERVABLE if report.servable else EXIT_REFUSED


# --- --load ----------------------------------------------------------------------------------


def resident_memory() -> dict[str, int]:
    """This process's resident memory in bytes (/proc/self/status): VmRSS, its anonymous and
    file-backed parts, and VmHWM (the highest VmRSS so far)."""
    wanted = {
        "VmRSS": "rss_bytes",
        "RssAnon": "rss_anon_bytes",
        "RssFile": "rss_file_bytes",
        "VmHWM": "peak_rss_bytes",
    }
    found: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in wanted:
                found[wanted[key]] = int(value.split()[0]) * 1024  # reported in kB
    return found


def measure_load(
    path: Path, dtype_name: str, kv_cache_gib: float = DeviceConfig.kv_cache_gib
) -> dict[str, Any]:
    """Load the model the worker's way and measure: the process's resident memory before (torch
    and the loader imported) and after, the bytes of the model's tensors, and the worker's
    memory budget once a KV cache of `kv_cache_gib` is allocated and one step has run."""
    import torch

    from services.worker import memory_budget
    from services.worker.config import GiB, resolve_dtype
    from services.worker.loaded_model import LoadedModel
    from services.worker.runner import ModelRunner
    from services.worker.server import warm_up

    dtype = resolve_dtype(dtype_name, "cpu")
    before = resident_memory()
    loaded = LoadedModel.load(str(path), dtype, "cpu", "auto")
    after = resident_memory()
    runner = ModelRunner.create(
        loaded, kv_cache_bytes=int(kv_cache_gib * GiB), block_size=16, seed=0
    )
    warm_up(runner)
    budget = memory_budget.measure(loaded.model, runner.kv_cache, loaded.path)
    storages: dict[int, int] = {}
    network = loaded.model
    tensors = [*network.parameters(), *network.buffers(), network.rope]
    if network.local_rope is not None:
        tensors.append(network.local_rope)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return {
        "dtype": dtype_name,
        "quantization": loaded.quantization,
        "before": before,
        "after": after,
        "model_tensor_bytes": sum(storages.values()),
        "memory_budget": asdict(budget),
    }


# --- text ------------------------------------------------------------------------------------


def format_report(report: ModelReport) -> str:
    rows: list[tuple[str, str]] = []
    source = "general.architecture" if report.format == "gguf" else "model_type"
    family = report.family or "not in the registry"
    rows.append(("family", f"{family} ({source} {report.source_architecture!r})"))
    if report.general_name:
        rows.append(("general.name", report.general_name))
    if report.num_parameters:
        rows.append(("parameters", f"{_count(report.num_parameters)} ({report.num_parameters:,})"))
    rows.append(("size on disk", _bytes(report.file_bytes)))
    for index, fmt in enumerate(report.tensor_formats):
        plural = "s" if fmt.num_tensors != 1 else ""
        at_load = ", ".join(
            f"{what} ({count})" if len(fmt.at_load) > 1 else what
            for what, count in fmt.at_load.items()
        )
        line = (
            f"{fmt.type:<5} {fmt.num_tensors:>4} tensor{plural:<1} "
            f"{_count(fmt.num_parameters):>7}  {_bytes(fmt.file_bytes):>10}"
        )
        line += f"  -> {at_load}" if at_load else ""
        rows.append(("tensors" if index == 0 else "", line))
    if report.weight_memory_bytes is not None:
        memory = ", ".join(
            f"{dtype} {_bytes(size)}" for dtype, size in report.weight_memory_bytes.items()
        )
        rows.append(("weight memory", f"{memory} (estimate, --quantization auto)"))
    arch = report.architecture
    if arch is not None:
        rows.append(("context", f"{arch.context_length:,} tokens"))
        rows.append(
            (
                "layers",
                f"{arch.num_layers}, hidden {arch.hidden_size}, MLP {arch.intermediate_size}",
            )
        )
        rows.append(
            (
                "attention",
                f"{arch.num_heads} heads, {arch.num_kv_heads} KV heads, head_dim {arch.head_dim}",
            )
        )
        rows.append(("vocab", f"{arch.vocab_size:,}"))
        rows.append(("rope theta", f"{arch.rope_theta:g}"))
        switches = [_switch(name, value) for name, value in arch.switches.items()]
        for index, text in enumerate(switches or ["none (a plain Llama decoder)"]):
            rows.append(("switches" if index == 0 else "", text))
    tokenizer = report.tokenizer
    support = "supported" if tokenizer.supported else f"not supported: {tokenizer.error}"
    rows.append(("tokenizer", f"{tokenizer.kind}: {support}"))
    rows.append(("chat template", report.chat_template or _no_template(report)))
    width = max(len(label) for label, _ in rows) + 2
    header = f"{report.name}  ({report.path})"
    return "\n".join([header, *(f"  {label:<{width}}{text}" for label, text in rows)])


def _no_template(report: ModelReport) -> str:
    """What chat does without a template: refused, unless the server is given one."""
    text = "none: chat requests are refused (completions work)"
    if report.suggested_chat_template:
        return f"{text}; serve with --chat-template {report.suggested_chat_template} to chat"
    return f"{text}; serve with --chat-template NAME or FILE to chat"


def format_load(report: ModelReport, load: dict[str, Any] | None, dtype: str) -> str:
    if load is None:
        return "  load           skipped: the model is refused"
    before, after = load["before"], load["after"]
    budget = MemoryBudget(**load["memory_budget"])
    memory = report.weight_memory_bytes or {}
    estimate = memory.get("float32" if dtype == "float32" else "bfloat16")
    estimated = f" (estimate {_bytes(estimate)})" if estimate is not None else ""
    return "\n".join(
        [
            f"  load ({dtype}, --quantization {load['quantization']})",
            f"    model tensors  {_bytes(load['model_tensor_bytes'])}{estimated}",
            f"    process RSS    {_bytes(before['rss_bytes'])} before (torch imported)"
            f" -> {_bytes(after['rss_bytes'])} after"
            f" (+{_bytes(after['rss_bytes'] - before['rss_bytes'])}: anonymous"
            f" +{_bytes(after['rss_anon_bytes'] - before['rss_anon_bytes'])}, file-backed"
            f" +{_bytes(after['rss_file_bytes'] - before['rss_file_bytes'])}),"
            f" peak {_bytes(after['peak_rss_bytes'])}",
            "    memory budget (after a warm-up step, as the worker logs it at start)",
            *(f"      {what:<12} {amount}" for what, amount in budget.lines()),
        ]
    )


def _switch(name: str, value: Any) -> str:
    if name == "sliding_window":
        return _windows(value)
    if name == "rope_scaling":
        return "rope scaling " + _rope(value)
    if name == "local_rope":
        return f"windowed layers' rope: theta {value['theta']:g}" + (
            f", {_rope(value)}" if "type" in value else ""
        )
    if name == "layers_without_rope":
        return f"no rope on layers {_layers(value)}"
    if name == "pre_norms":
        return "no pre-norms (norms on the attention and MLP outputs only)"
    if name == "post_norms":
        return "post-norms on the attention and MLP outputs"
    if name == "qk_norm":
        return f"QK-norm {value.replace('_', ' ')}"
    if name == "hidden_act":
        return f"activation {value} (GeGLU)" if value == "gelu_tanh" else f"activation {value}"
    if name == "attention_scale":
        return f"query scale {value:.4g} (not head_dim ** -0.5)"
    if value is True:
        return name.replace("_", " ")
    return f"{name.replace('_', ' ')} {value:g}" if isinstance(value, float) else f"{name} {value}"


def _windows(pattern: dict[str, Any]) -> str:
    sizes = "/".join(str(s) for s in pattern["sizes"])
    windowed, num_layers = pattern["windowed_layers"], pattern["num_layers"]
    if windowed == num_layers:
        return f"sliding window {sizes} on every layer"
    period = pattern["period"]
    full = pattern["full_attention_layers"]
    if period is not None:
        share = f"{period - sum(1 for i in full if i < period)} of every {period}"
    else:
        share = f"{windowed} of {num_layers}"
    return (
        f"sliding window {sizes} on {share} layers"
        f" (full attention on layers {_layers(pattern['full_attention_layers'])})"
    )


def _rope(scaling: dict[str, Any]) -> str:
    parts = [str(scaling["type"])]
    if "factor" in scaling:
        parts.append(f"factor {scaling['factor']:g}")
    if "original_context_length" in scaling:
        parts.append(f"original context {scaling['original_context_length']:,}")
    return ", ".join(parts)


def _layers(layers: list[int]) -> str:
    shown = ", ".join(str(i) for i in layers[:_LIST_LIMIT])
    return shown + (f", ... ({len(layers)} layers)" if len(layers) > _LIST_LIMIT else "")


def _count(value: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(value)


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"
