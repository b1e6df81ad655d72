"""`llmserve bench peers --shapes`: llama.cpp's tools and llmserve on the same real-size GGUF
file (benchmarks/model_shapes.py builds it once into the cache), one engine loaded at a time;
per file one table with llmserve's advantage over llama.cpp and each engine's share of the
machine's roofs, measured once before any engine starts (machine_peaks.py).

    llmserve bench peers --shapes llama-3.2-1b:Q4_K_M,llama-3.2-1b:Q4_0,llama-3.2-3b
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import command_line, cpu_model_name, cpu_simd_flags, load_average
from benchmarks.compare import PeersConfig
from benchmarks.llamacpp_build import PeerBinaries, PeerBuildError, build_info, ensure_built
from benchmarks.machine_peaks import MachinePeaks
from benchmarks.model_shapes import ShapeBuildError, build, describe, shape_file
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
from benchmarks.peers_table import measures, workload_settings
from benchmarks.shapes_table import (
    SHAPES_LEGEND,
    FileWeights,
    ShapeRef,
    file_engines,
    file_header,
    file_weights,
    roof_percents,
    shape_table,
)

PEAKS_TIMEOUT_S = 300


def ensure_shape_files(refs: Sequence[ShapeRef]) -> dict[str, Path]:
    """Each file by its label, built into the cache the first time (model_shapes shows the
    converter's and llama-quantize's progress)."""
    paths: dict[str, Path] = {}
    for ref in refs:
        path = shape_file(ref.shape, ref.quant_type)
        if path.is_file():
            print(f"{ref.label}: {path}", flush=True)
        else:
            print(f"{ref.label}: not built yet, building once into {path.parent}", flush=True)
            print(f"  {describe(ref.shape)}", flush=True)
            started = time.monotonic()
            path = build(ref.shape, [ref.quant_type])[ref.quant_type]
            print(f"  built {path} in {time.monotonic() - started:.0f} s", flush=True)
        paths[ref.label] = path
    return paths


def read_weights(path: Path) -> FileWeights:
    from services.common.gguf_index import GGUFIndex

    return file_weights(GGUFIndex(path).tensors)


def measure_peaks(python: str, threads: int) -> MachinePeaks:
    """machine_peaks in a process of its own, so that its buffer and torch leave with it
    before any engine loads."""
    command = [python, "-m", "benchmarks.machine_peaks", "--threads", str(threads), "--json"]
    print(f"$ {shlex.join(command)}", flush=True)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=PEAKS_TIMEOUT_S, check=False
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"machine_peaks exited with {done.returncode}: {done.stderr[-2000:]}")
    return MachinePeaks.from_json(json.loads(done.stdout.strip().splitlines()[-1]))


def run_shapes(
    args: argparse.Namespace,
    config: PeersConfig,
    workloads: Sequence[str],
    refs: Sequence[ShapeRef],
    with_llamacpp: bool,
    llmserve_quantizations: Sequence[str],
    llmserve_drafting: Sequence[bool] = (True,),
) -> int:
    """Every workload of `workloads` on each file, llama.cpp first, then llmserve per
    quantization (and the stack with --with-stack); returns the command's exit code."""
    binaries: PeerBinaries | None = None
    try:
        if with_llamacpp or args.build_only:
            binaries = ensure_built(force=args.rebuild)
        paths = ensure_shape_files(refs)
    except (ShapeBuildError, PeerBuildError, OSError) as exc:
        print(f"bench peers: {exc}", file=sys.stderr)
        return 1
    if args.build_only:
        assert binaries is not None
        print("\n".join([str(binaries.bin_dir), *(str(path) for path in paths.values())]))
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_at_start = load_average()
    print(f"cpu: {cpu_model_name()}; {load_at_start}\n{workload_settings(config)}", flush=True)
    try:
        peaks = measure_peaks(sys.executable, config.threads)
    except (RuntimeError, ValueError, KeyError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"bench peers: measuring the machine's peaks: {exc}", file=sys.stderr)
        return 1
    machine = "\n".join(
        [
            f"cpu: {cpu_model_name()}; cpu flags: {' '.join(cpu_simd_flags()) or 'unknown'}",
            peaks.bandwidth_line(),
            peaks.int8_line(),
        ]
    )
    print(machine + "\n", flush=True)
    table_measures = measures(config, workloads)
    stack_quantizations = llmserve_quantizations if args.with_stack else []
    sections: list[str] = []
    files: list[dict[str, object]] = []
    failed = False
    for ref in refs:
        path = paths[ref.label]
        weights = read_weights(path)
        header = file_header(ref, path, weights)
        engines = file_engines(
            ref, path, with_llamacpp, llmserve_quantizations, stack_quantizations, llmserve_drafting
        )
        print(header + "\n", flush=True)
        runner = Runner(config, list(workloads), out_dir / ref.slug, binaries)
        runner.out_dir.mkdir(parents=True, exist_ok=True)
        results = run_engines(runner, engines)
        values = measured_values(results)
        table = shape_table(table_measures, engines, values, weights, peaks)
        problems = run_problems(engines, results)
        notes = "".join(f"\n- {p}" for p in problems)
        section = f"{header}\n{machine}\n\n{table}\n\n{SHAPES_LEGEND}\n" + (
            f"\nproblems:{notes}\n" if problems else ""
        )
        print("\n" + section, flush=True)
        sections.append(section)
        failed = failed or any_failed(results)
        files.append(
            {
                "shape": ref.label,
                "path": str(path),
                "num_params": weights.num_params,
                "weight_bytes_per_token": weights.bytes_per_token,
                "engines": [engine_record(e) for e in engines],
                "values": json_values(values),
                "percent_of_roof": json_values(
                    roof_percents(table_measures, engines, values, weights, peaks)
                ),
                "runs": {n: {w: asdict(r) for w, r in runs.items()} for n, runs in results.items()},
                "problems": problems,
                "table": table,
            }
        )
    load_at_end = load_average().removeprefix("load average at start: ")
    settings = (
        f"{workload_settings(config)}\n{load_at_start}; at the end: {load_at_end}\n"
        f"command: `{command_line()}`"
    )
    report = settings + "\n\n" + "\n".join(sections)
    document = {
        "command": command_line(),
        "cpu": cpu_model_name(),
        "cpu_flags": cpu_simd_flags(),
        "machine_peaks": {
            **peaks.to_json(),
            "bandwidth_line": peaks.bandwidth_line(),
            "int8_line": peaks.int8_line(),
        },
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_at_end,
        "config": asdict(config),
        "llamacpp_build": build_info() if binaries else None,
        "measures": [asdict(m) for m in table_measures],
        "files": files,
    }
    json_out = Path(args.json_out) if args.json_out else out_dir / "peers.json"
    json_out.write_text(json.dumps(document, indent=1, default=json_default))
    (out_dir / "peers.md").write_text(report)
    print(f"wrote {json_out} and {out_dir / 'peers.md'}")
    return 1 if failed else 0
