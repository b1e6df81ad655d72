"""llmserve against llama.cpp's OpenAI-compatible server (llama-cpp-python), on the same GGUF
file, the same cores and the same client: `llmserve bench serve` at each concurrency.

    python -m services.bench.compare --llamacpp-python /work/llamacpp-venv/bin/python

The engines run one after the other, never both loaded at once: start one, wait until it
answers, run every concurrency against it, stop it, then the next. Each run is a separate
`llmserve bench serve` process writing its own JSON; this module only starts servers and
tabulates. Both engines get the same prompts and a fixed output length (ignore_eos for
llmserve, min_tokens for llama-cpp-python), so only the engine differs. The prompts are random
tokens sent as text (`--dataset synthetic-text`), since llama-cpp-python takes no token ids.

llama-cpp-python's server runs one request at a time (one Llama object behind a lock; it has no
parallel slots, unlike llama.cpp's C++ `llama-server --parallel N`), so at concurrency > 1 its
requests queue: TTFT grows with the queue while TPOT stays that of batch 1. It is started with
`--interrupt_requests False`: by default a new request cuts the streaming one short.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench.common import format_table, load_average, parse_int_list

ENGINES = ("llmserve", "llamacpp")
ENGINE_TITLES = {"llmserve": "llmserve", "llamacpp": "llama.cpp"}
DEFAULT_LLAMACPP_PYTHON = "/work/llamacpp-venv/bin/python"
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class CompareConfig:
    model: Path
    concurrencies: tuple[int, ...]
    input_len: int
    output_len: int
    min_prompts: int
    prompts_per_concurrency: int
    warmup: int
    threads: int
    seed: int
    out_dir: Path
    llamacpp_python: str
    llamacpp_ctx: int
    llmserve_dtype: str

    def num_prompts(self, concurrency: int) -> int:
        """Enough requests for a few waves at the concurrency, at least `min_prompts`."""
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)


@dataclass(slots=True)
class Server:
    name: str
    command: list[str]
    target: str
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self, out_dir: Path) -> None:
        # A ready file left by an earlier run would make the wait return before this start.
        (out_dir / "llmserve-ready.json").unlink(missing_ok=True)
        self.log_path = out_dir / f"{self.name}-server.log"
        with self.log_path.open("wb") as log:
            # Its own process group (setsid), so stopping it reaches every process it spawned.
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def fail_if_dead(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}; see {self.log_path}"
            )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llmserve_server(config: CompareConfig) -> Server:
    port = free_port()
    max_num_seqs = max(config.concurrencies)
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--port",
        str(port),
        "--model",
        str(config.model),
        "--dtype",
        config.llmserve_dtype,
        "--worker-threads",
        str(config.threads),
        "--max-num-seqs",
        str(max_num_seqs),
        "--ready-file",
        str(config.out_dir / "llmserve-ready.json"),
    ]
    return Server("llmserve", command, f"grpc://127.0.0.1:{port}")


def llamacpp_server(config: CompareConfig) -> Server:
    port = free_port()
    command = [
        config.llamacpp_python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(config.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(config.threads),
        "--n_threads_batch",
        str(config.threads),
        "--n_ctx",
        str(config.llamacpp_ctx),
        "--interrupt_requests",
        "False",
    ]
    return Server("llamacpp", command, f"http://127.0.0.1:{port}/v1")


def wait_ready(server: Server, config: CompareConfig) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        server.fail_if_dead()
        if server.name == "llmserve":
            if (config.out_dir / "llmserve-ready.json").exists():
                return
        else:
            try:
                with urllib.request.urlopen(server.target + "/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} not ready after {STARTUP_TIMEOUT_S:.0f} s")


def bench_command(server: Server, config: CompareConfig, concurrency: int, out: Path) -> list[str]:
    # `python -m services.bench.serve` is `llmserve bench serve` without importing every other
    # subcommand, so a half-edited module elsewhere in the tree cannot stop the client.
    return [
        sys.executable,
        "-m",
        "services.bench.serve",
        "--target",
        server.target,
        "--dataset",
        "synthetic-text",
        "--tokenizer",
        str(config.model),
        "--concurrency",
        str(concurrency),
        "--num-prompts",
        str(config.num_prompts(concurrency)),
        "--input-len",
        str(config.input_len),
        "--output-len",
        str(config.output_len),
        "--warmup",
        str(config.warmup),
        "--seed",
        str(config.seed),
        "--json-out",
        str(out),
    ]


def read_run(path: Path, exit_code: int) -> dict[str, Any]:
    """The part of one `bench serve` JSON the comparison keeps."""
    if not path.exists():
        return {"exit_code": exit_code, "json": None, "summary": None}
    document = json.loads(path.read_text())
    return {
        "exit_code": exit_code,
        "json": str(path),
        "load_average_at_start": document["load_average_at_start"],
        "summary": document["points"][0]["summary"],
    }


def run_engine(name: str, config: CompareConfig) -> dict[int, dict[str, Any]]:
    """Start the engine, bench it at every concurrency, stop it. Returns the summary of each
    concurrency (a failed run is recorded with its error, the others still run)."""
    server = llmserve_server(config) if name == "llmserve" else llamacpp_server(config)
    print(f"\n# {ENGINE_TITLES[name]}: {shlex.join(server.command)}", flush=True)
    results: dict[int, dict[str, Any]] = {}
    server.start(config.out_dir)
    try:
        started = time.monotonic()
        wait_ready(server, config)
        print(f"ready after {time.monotonic() - started:.1f} s", flush=True)
        for concurrency in config.concurrencies:
            out = config.out_dir / f"{name}-c{concurrency}.json"
            command = bench_command(server, config, concurrency, out)
            print(f"\n$ {shlex.join(command)}", flush=True)
            out.unlink(missing_ok=True)  # never tabulate an earlier run's file
            code = subprocess.call(command)
            server.fail_if_dead()
            results[concurrency] = read_run(out, code)
    finally:
        server.stop()
    return results


# The side-by-side table: one row per concurrency, each metric once per engine.
METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("output tok/s", ("output_tokens_per_s",)),
    ("TTFT p50 ms", ("ttft", "p50_ms")),
    ("TTFT p99 ms", ("ttft", "p99_ms")),
    ("TPOT p50 ms", ("tpot", "p50_ms")),
    ("E2E p50 ms", ("e2e", "p50_ms")),
)


def _metric(summary: dict[str, Any] | None, path: Sequence[str]) -> float:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict):
            return float("nan")
        value = value.get(key)
    return float("nan") if value is None else float(value)


def comparison_table(
    results: dict[str, dict[int, dict[str, Any]]], concurrencies: Sequence[int]
) -> str:
    engines = [engine for engine in ENGINES if engine in results]
    headers = ["concurrency", "requests ok"]
    for title, _ in METRICS:
        headers += [f"{title} {ENGINE_TITLES[engine]}" for engine in engines]
    rows: list[list[object]] = []
    for concurrency in concurrencies:
        summaries = {e: (results[e].get(concurrency) or {}).get("summary") for e in engines}
        completed = "/".join(str((summaries[e] or {}).get("num_completed", 0)) for e in engines)
        row: list[object] = [concurrency, completed]
        for _, path in METRICS:
            row += [_metric(summaries[e], path) for e in engines]
        rows.append(row)
    return format_table(headers, rows)


def run(args: argparse.Namespace) -> int:
    from services.common.model_source import resolve_model_path

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        print(f"compare: --engines takes {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = CompareConfig(
        model=resolve_model_path(args.model),
        concurrencies=tuple(parse_int_list(args.concurrency)),
        input_len=args.input_len,
        output_len=args.output_len,
        min_prompts=args.min_prompts,
        prompts_per_concurrency=args.prompts_per_concurrency,
        warmup=args.warmup,
        threads=args.threads,
        seed=args.seed,
        out_dir=out_dir,
        llamacpp_python=args.llamacpp_python,
        llamacpp_ctx=args.llamacpp_ctx,
        llmserve_dtype=args.dtype,
    )
    print(f"model: {config.model}\n{load_average()}", flush=True)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for engine in engines:
        if args.tabulate_only:
            files = {c: out_dir / f"{engine}-c{c}.json" for c in config.concurrencies}
            results[engine] = {c: read_run(path, 0) for c, path in files.items()}
            continue
        try:
            results[engine] = run_engine(engine, config)
        except (RuntimeError, TimeoutError, OSError) as exc:
            errors[engine] = str(exc)
            print(f"compare: {engine} failed: {exc}", file=sys.stderr)
    table = comparison_table(results, config.concurrencies) if results else "(no results)"
    settings = (
        f"{config.input_len}-token random prompts (as text), {config.output_len} output tokens "
        f"(ignore_eos / min_tokens), num_prompts = max({config.min_prompts}, "
        f"{config.prompts_per_concurrency} x concurrency), warm-up {config.warmup}, "
        f"{config.threads} threads each; llmserve dtype {config.llmserve_dtype}"
    )
    print(f"\n{settings}\n\n{table}")
    document = {
        "model": str(config.model),
        "settings": {
            "concurrencies": list(config.concurrencies),
            "num_prompts": {c: config.num_prompts(c) for c in config.concurrencies},
            "input_len": config.input_len,
            "output_len": config.output_len,
            "warmup": config.warmup,
            "threads": config.threads,
            "seed": config.seed,
            "llmserve_dtype": config.llmserve_dtype,
            "llamacpp_ctx": config.llamacpp_ctx,
        },
        "results": {
            engine: {str(c): r for c, r in runs.items()} for engine, runs in results.items()
        },
        "errors": errors,
        "table": table,
    }
    json_out = Path(args.json_out) if args.json_out else out_dir / "comparison.json"
    json_out.write_text(json.dumps(document, indent=1))
    (out_dir / "comparison.md").write_text(settings + "\n\n" + table + "\n")
    print(f"\nwrote {json_out} and {out_dir / 'comparison.md'}")
    return 1 if errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help=".gguf file (default: embedded model)")
    parser.add_argument("--engines", default="llmserve,llamacpp", help="which, in this order")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--prompts-per-concurrency", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per run")
    parser.add_argument("--threads", type=int, default=2, help="compute threads per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="llmserve weights/activations")
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("LLAMACPP_PYTHON", DEFAULT_LLAMACPP_PYTHON),
        help="a python with llama-cpp-python[server] installed (env LLAMACPP_PYTHON)",
    )
    parser.add_argument("--llamacpp-ctx", type=int, default=2048, help="llama.cpp --n_ctx")
    parser.add_argument("--out-dir", default="bench-results/vs-llamacpp")
    parser.add_argument("--json-out", default=None, help="default: OUT_DIR/comparison.json")
    parser.add_argument(
        "--tabulate-only",
        action="store_true",
        help="start nothing: rebuild the table from the runs' JSON files already in OUT_DIR",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
