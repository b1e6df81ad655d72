"""`llmserve bench peers`: llmserve against llama.cpp's own C++ tools on this machine, the same
GGUF files, the same thread count, one system loaded at a time; one markdown table.

    llmserve bench peers                                    # every workload and engine
    llmserve bench peers --build-only                       # build llama.cpp (cached) and stop
    llmserve bench peers --workloads a,d --engines llamacpp-q4_0,llmserve \\
        --single-user-prompts 4 --output-len 16             # a quick look
    llmserve bench peers --shapes llama-3.2-1b:Q4_K_M,llama-3.2-3b   # real sizes, a table each

Engines (columns): llama.cpp on the Q4_0 and Q4_K_M requants and on the shipped Q4_1 file
(llama-server, llama-batched-bench, llama-bench); llmserve in-process, once per
--llmserve-quantization and per --llmserve-files file (default: the shipped one); with
--with-stack also the `llmserve up` stack over gRPC. Workloads (rows) a-d: see
compare.py and docs/benchmarks.md. Building llama.cpp: llamacpp_build.py.

With --shapes the files are real-size random models (model_shapes.py) instead: both sides run
each file, one table per file beside the machine's roofs (peers_shapes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from benchmarks.common import command_line, cpu_model_name, cpu_simd_flags, load_average
from benchmarks.compare import (
    LLAMACPP_QUANTS,
    SHIPPED_QUANT,
    WORKLOADS,
    PeersConfig,
    engine_specs,
    parse_list,
)
from benchmarks.llamacpp_build import (
    PeerBinaries,
    PeerBuildError,
    build_info,
    ensure_built,
    ensure_requant,
)
from benchmarks.model_shapes import SHAPES
from benchmarks.peers_runner import (
    Runner,
    any_failed,
    engine_record,
    json_default,
    json_values,
    measured_values,
    run_engines,
    run_problems,
)
from benchmarks.peers_shapes import run_shapes
from benchmarks.peers_table import RATIO_LEGEND, measures, peers_table, settings_line
from benchmarks.shapes_table import DEFAULT_TYPE, ShapeRef, parse_shapes_spec

ENGINE_CHOICES = (
    "llamacpp-q4_0",
    "llamacpp-q4_1",
    "llamacpp-q4_k_m",
    "llmserve",
    "llmserve-nospec",
)


def llmserve_drafting(chosen: Sequence[str]) -> list[bool]:
    """The in-process columns' speculation settings: `llmserve` is the server's default,
    `llmserve-nospec` the same with --no-speculation (one token per step, as llama-server)."""
    return [
        drafting
        for name, drafting in (("llmserve", True), ("llmserve-nospec", False))
        if name in chosen
    ]


# ---- the command -------------------------------------------------------------------------


def engine_default_quantization() -> str:
    from services.engine.config import EngineConfig

    return str(next(f.default for f in fields(EngineConfig) if f.name == "quantization"))


def llmserve_quantizations(text: str | None) -> list[str]:
    """The --llmserve-quantization values, checked now rather than in each engine's run."""
    from services.worker.quantization.formats import check_quantization

    values = [q.strip() for q in (text or "").split(",") if q.strip()]
    values = list(dict.fromkeys(values)) or [engine_default_quantization()]
    for value in values:
        check_quantization(value)
    return values


def config_from_args(args: argparse.Namespace) -> PeersConfig:
    config = PeersConfig(
        input_len=args.input_len,
        output_len=args.output_len,
        single_user_prompts=args.single_user_prompts,
        num_users=args.num_users,
        requests_per_user=args.requests_per_user,
        offline_batch=args.offline_batch,
        prefill_lens=tuple(int(n) for n in args.prefill_lens.split(",") if n.strip()),
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
    )
    sizes = {
        "--input-len": config.input_len,
        "--output-len": config.output_len,
        "--single-user-prompts": config.single_user_prompts,
        "--num-users": config.num_users,
        "--requests-per-user": config.requests_per_user,
        "--offline-batch": config.offline_batch,
        "--repeats": config.repeats,
        "--threads": config.threads,
        "--prefill-lens": min(config.prefill_lens, default=0),
    }
    bad = [flag for flag, value in sizes.items() if value < 1]
    if bad or (config.warmup is not None and config.warmup < 0):
        raise ValueError(f"must be positive: {', '.join(bad) or '--warmup'}")
    return config


def shape_refs(args: argparse.Namespace) -> list[ShapeRef]:
    """--shapes names the files both sides run: --model and --llmserve-files do not apply."""
    if args.model is not None or args.llmserve_files is not None:
        raise ValueError("--shapes names the files; leave out --model and --llmserve-files")
    return parse_shapes_spec(args.shapes)


def run(args: argparse.Namespace) -> int:
    from services.common.model_source import resolve_model_path

    try:
        config = config_from_args(args)
        workloads = parse_list(args.workloads, WORKLOADS, "--workloads")
        chosen = parse_list(args.engines, ENGINE_CHOICES, "--engines")
        quantizations = llmserve_quantizations(args.llmserve_quantization)
        if args.shapes is not None:
            refs = shape_refs(args)
        else:
            files = parse_list(
                args.llmserve_files or SHIPPED_QUANT, LLAMACPP_QUANTS, "--llmserve-files"
            )
            model = resolve_model_path(args.model)
    except (ValueError, OSError) as exc:
        print(f"bench peers: {exc}", file=sys.stderr)
        return 2
    if args.shapes is not None:
        with_llamacpp = any(engine.startswith("llamacpp-") for engine in chosen)
        drafting = llmserve_drafting(chosen)
        on_llmserve = quantizations if drafting else []
        return run_shapes(args, config, workloads, refs, with_llamacpp, on_llmserve, drafting)
    llamacpp_quants = [q for q in LLAMACPP_QUANTS if f"llamacpp-{q.lower()}" in chosen]
    binaries: PeerBinaries | None = None
    models = {SHIPPED_QUANT: model}
    requants = {q for q in [*llamacpp_quants, *files] if q != SHIPPED_QUANT}
    if requants or llamacpp_quants or args.build_only:
        try:
            binaries = ensure_built(force=args.rebuild)
            for quant in sorted(requants | ({"Q4_0"} if args.build_only else set())):
                models[quant] = ensure_requant(binaries, model, quant)
        except PeerBuildError as exc:
            print(f"bench peers: {exc}", file=sys.stderr)
            return 1
    if args.build_only:
        assert binaries is not None
        print(f"{binaries.bin_dir}\n{models['Q4_0']}")
        return 0
    drafting = llmserve_drafting(chosen)
    engines = engine_specs(
        llamacpp_quants,
        quantizations if drafting else [],
        quantizations if args.with_stack else [],
        models,
        model,
        files,
        drafting,
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_at_start = load_average()
    flags_line = f"cpu flags: {' '.join(cpu_simd_flags()) or 'unknown'}"
    print(f"cpu: {cpu_model_name()} ({os.cpu_count()} logical cores); {load_at_start}")
    print(settings_line(config, engines) + "\n", flush=True)
    results = run_engines(Runner(config, workloads, out_dir, binaries), engines)
    values = measured_values(results)
    table_measures = measures(config, workloads)
    table = peers_table(table_measures, engines, values)
    problems = run_problems(engines, results)
    load_at_end = load_average().removeprefix("load average at start: ")
    settings = (
        f"cpu: {cpu_model_name()}; {flags_line}\n{settings_line(config, engines)}\n"
        f"{load_at_start}; at the end: {load_at_end}"
    )
    notes = "\n".join(f"- {p}" for p in problems)
    legend = RATIO_LEGEND if any(not e.is_llmserve for e in engines) else ""
    report = f"{settings}\n\n{table}\n\n{legend}\n" + (
        f"\nproblems:\n{notes}\n" if problems else ""
    )
    print("\n" + report)
    document = {
        "command": command_line(),
        "cpu": cpu_model_name(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_at_end,
        "config": asdict(config),
        "llamacpp_build": build_info() if binaries else None,
        "engines": [engine_record(e) for e in engines],
        "measures": [asdict(m) for m in table_measures],
        "values": json_values(values),
        "runs": {name: {w: asdict(r) for w, r in runs.items()} for name, runs in results.items()},
        "problems": problems,
        "table": table,
    }
    json_out = Path(args.json_out) if args.json_out else out_dir / "peers.json"
    json_out.write_text(json.dumps(document, indent=1, default=json_default))
    (out_dir / "peers.md").write_text(report)
    print(f"wrote {json_out} and {out_dir / 'peers.md'}")
    return 1 if any_failed(results) else 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    defaults = PeersConfig()
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="a (1 user), b (many users), c (offline batch), d (prefill); comma-separated",
    )
    parser.add_argument(
        "--engines",
        default=",".join(c for c in ENGINE_CHOICES if c != "llmserve-nospec"),
        help=f"some of {', '.join(ENGINE_CHOICES)}, comma-separated (default: all but "
        "llmserve-nospec, llmserve with --no-speculation)",
    )
    parser.add_argument(
        "--llmserve-quantization",
        default=None,
        help="one llmserve column per value, e.g. none,gguf (default: the engine's default)",
    )
    parser.add_argument(
        "--llmserve-files",
        default=None,
        help=f"the GGUF files llmserve runs, some of {', '.join(LLAMACPP_QUANTS)} (the shipped"
        f" {SHIPPED_QUANT} file, llama-quantize's requants of it), comma-separated"
        f" (default: {SHIPPED_QUANT})",
    )
    parser.add_argument(
        "--shapes",
        default=None,
        metavar="SPEC",
        help="real-size files instead, e.g. llama-3.2-1b:Q4_K_M,llama-3.2-3b:Q4_K_M (no type:"
        f" {DEFAULT_TYPE}; shapes: {', '.join(SHAPES)}), built once into the cache; llama.cpp"
        " (any llamacpp-* of --engines) and llmserve run each, one table per file",
    )
    parser.add_argument(
        "--with-stack",
        action="store_true",
        help="also the `llmserve up` stack over gRPC (workloads a, b)",
    )
    parser.add_argument(
        "--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--enforce-eager", action="store_true", help="llmserve: no step graphs")
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF loaded as shipped by llmserve and the llamacpp-q4_1 column; "
        "llamacpp-q4_0 loads its Q4_0 requant (default: the embedded Q4_1 file)",
    )
    shape = parser.add_argument_group("workload shapes")
    shape.add_argument("--input-len", type=int, default=defaults.input_len)
    shape.add_argument("--output-len", type=int, default=defaults.output_len)
    shape.add_argument(
        "--single-user-prompts", type=int, default=defaults.single_user_prompts, help="a"
    )
    shape.add_argument("--num-users", type=int, default=defaults.num_users, help="b")
    shape.add_argument(
        "--requests-per-user", type=int, default=defaults.requests_per_user, help="b"
    )
    shape.add_argument("--offline-batch", type=int, default=defaults.offline_batch, help="c")
    shape.add_argument(
        "--prefill-lens",
        default=",".join(str(n) for n in defaults.prefill_lens),
        help="d: prompt lengths, comma-separated",
    )
    shape.add_argument("--repeats", type=int, default=defaults.repeats, help="c, d")
    shape.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="a, b: untimed requests first (default: 2 for a, one per user for b)",
    )
    shape.add_argument("--threads", type=int, default=defaults.threads)
    shape.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out-dir", default="bench-results/peers")
    parser.add_argument("--json-out", default=None, help="default: OUT_DIR/peers.json")
    build = parser.add_argument_group("llama.cpp build")
    build.add_argument("--build-only", action="store_true", help="build (cached) and stop")
    build.add_argument("--rebuild", action="store_true", help="rebuild even if cached")
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "peers",
        help="llmserve vs llama.cpp's C++ server and benchmarks, one table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure_parser(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
