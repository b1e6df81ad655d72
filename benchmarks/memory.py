"""`llmserve bench memory`: what serving a model file costs in memory, llmserve's worker against
llama-server, at the same KV capacity; one table.

    llmserve bench memory                                   # the embedded model
    llmserve bench memory --models llama-3.2-1b:Q4_K_M,llama-3.1-8b --context 8192 --slots 16
    llmserve bench memory --models /path/to/model.gguf --json memory.json

For each file, one process at a time (never both at once), each after the file has been read
into the page cache (so neither pays for the disk):

  llmserve    `llmserve worker --model FILE` alone (the process holding weights and KV cache),
              with --kv-cache-gib for exactly llama-server's KV bytes, --kv-cache-dtype float16
              (what `auto` picks for a GGUF on a CPU), --max-num-seqs SLOTS and --max-model-len
              CONTEXT; ready when its gRPC health says SERVING.
  llama-server `-t THREADS -c CONTEXT -np SLOTS --cache-ram 0` (no prompt cache in RAM, which
              would grow with requests); ready when /health answers 200.

KV capacity: llama-server keeps K and V in f16 for CONTEXT tokens, 2 * layers * kv_heads *
head_dim * 2 bytes per token (a sliding-window model's window layers may take less: its log's
figure is in the JSON). Measured per process tree (/proc/PID/status, children included): peak
RSS (VmHWM, start-up included), RSS once ready, and steady RSS after one short request
(PROMPT_LEN prompt tokens, OUTPUT_LEN generated greedily).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MiB,
    command_line,
    cpu_model_name,
    cpu_simd_flags,
    load_average,
    random_prompts,
)
from benchmarks.memory_table import (
    EngineMemory,
    FileMemory,
    kv_cache_gib,
    kv_geometry,
    memory_table,
    mib,
    read_gguf_metadata,
    tree_notes,
)
from benchmarks.process_memory import MemoryStatus, TreeMemory

SAMPLE_INTERVAL_S = 0.1
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
SETTLE_S = 1.0
"""Wait after the request before reading the steady RSS."""
ENGINES = ("llmserve", "llama-server")
BUILD_HINT = "python -m benchmarks.llamacpp_build (about 10 min on 2 cores)"


# ---- processes ---------------------------------------------------------------------------


def free_port() -> int:
    from services.launcher import free_port as launcher_free_port

    return launcher_free_port("127.0.0.1")


def warm_page_cache(path: Path) -> None:
    """Read the file once so that each engine starts from a warm page cache."""
    with path.open("rb") as file:
        while file.read(16 * MiB):
            pass


class Measured:
    """A server process in its own session, its tree sampled while it starts and serves;
    always killed on exit."""

    def __init__(self, command: list[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.command = command
        self.log_path = log_path
        self.env = dict(env)
        self.process: subprocess.Popen[bytes] | None = None
        self.memory: TreeMemory | None = None
        self.started = 0.0

    def __enter__(self) -> Measured:
        print(f"$ {shlex.join(self.command)}", flush=True)
        with self.log_path.open("wb") as log:
            self.started = time.monotonic()
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.memory = TreeMemory(self.process.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, ready: Any, timeout_s: float) -> float:
        """Sample memory until `ready()` is true; the seconds since start."""
        assert self.memory is not None
        deadline = self.started + timeout_s
        while True:
            self.memory.sample()
            self.fail_if_dead()
            if ready():
                elapsed = time.monotonic() - self.started
                self.memory.sample()
                return elapsed
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(SAMPLE_INTERVAL_S)

    def fail_if_dead(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(
                f"exited with {self.process.returncode}; {self.log_path}:\n" + "\n".join(tail)
            )

    def status(self) -> MemoryStatus:
        assert self.memory is not None
        self.memory.sample()
        return self.memory.current()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def record_memory(result: EngineMemory, server: Measured, ready: MemoryStatus) -> None:
    assert server.memory is not None
    steady = server.status()
    result.peak_mib = mib(server.memory.peak_kib)
    result.ready_rss_mib = mib(ready.rss_kib)
    result.steady_rss_mib = mib(steady.rss_kib)
    result.steady_anon_mib = mib(steady.rss_anon_kib)
    result.steady_file_mib = mib(steady.rss_file_kib)
    result.num_processes = server.memory.num_processes


# ---- llmserve's worker -------------------------------------------------------------------


def worker_command(
    model: Path, port: int, kv_bytes: int, context: int, slots: int, threads: int
) -> list[str]:
    from services.launcher import llmserve_command

    return llmserve_command(
        "worker",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-gib",
        repr(kv_cache_gib(kv_bytes)),
        "--kv-cache-dtype",
        "float16",
        "--max-num-seqs",
        str(slots),
        "--max-model-len",
        str(context),
        "--threads",
        str(threads),
    )


async def worker_request(address: str, prompt: list[int], output_len: int) -> tuple[int, int, str]:
    """One greedy request driven over the Step stream as a scheduler would (prefill, then one
    decode step per token); returns (tokens generated, KV tokens, KV dtype)."""
    from services.contracts.sampling_params import SamplingParams
    from services.contracts.step import BatchPlan, NewSequence
    from services.scheduler.worker_client import WorkerClient

    client = WorkerClient(address, None)
    try:
        described = await client.describe()
        blocks = list(range(math.ceil((len(prompt) + output_len) / described.block_size)))
        sampling = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
        request_id = "memory-probe"
        stream = await client.open_steps()
        sequence = NewSequence(request_id, prompt, len(prompt), blocks, 0, sampling)
        plan = BatchPlan(0, [sequence], num_scheduled_tokens={request_id: len(prompt)})
        generated = 0
        for step in range(output_len):
            await stream.write(plan)
            generated += len((await stream.read()).token_ids(request_id))
            plan = BatchPlan(step + 1, num_scheduled_tokens={request_id: 1})
        await stream.write(BatchPlan(output_len, finished_request_ids=[request_id]))
        await stream.read()
        kv_tokens = described.num_kv_blocks * described.block_size
        return generated, kv_tokens, described.kv_cache_dtype
    finally:
        await client.close()


def measure_llmserve(model: Path, kv_bytes: int, args: argparse.Namespace) -> EngineMemory:
    from services.healthcheck import healthy

    port = free_port()
    address = f"127.0.0.1:{port}"
    command = worker_command(model, port, kv_bytes, args.context, args.slots, args.threads)
    result = EngineMemory("llmserve", command)
    # No internal secret: the port is loopback and this process is its only caller.
    env = {k: v for k, v in os.environ.items() if k != "LLMSERVE_INTERNAL_SECRET"}
    env["PYTHONUNBUFFERED"] = "1"
    log_path = Path(args.out_dir) / f"{model.stem}.llmserve.log"
    result.log = str(log_path)
    try:
        with Measured(command, log_path, env) as server:
            result.ready_s = server.wait_ready(lambda: healthy(address), args.startup_timeout)
            ready = server.status()
            prompt = random_prompts(1, args.prompt_len, seed=args.seed)[0]
            generated, kv_tokens, kv_dtype = asyncio.run(
                asyncio.wait_for(
                    worker_request(address, prompt, args.output_len), REQUEST_TIMEOUT_S
                )
            )
            result.generated_tokens, result.kv_tokens = generated, kv_tokens
            result.kv_mib = kv_tokens * (kv_bytes // args.context) / MiB
            if kv_dtype != "float16":
                result.error = f"the worker's KV cache is {kv_dtype}, not float16"
            time.sleep(SETTLE_S)
            server.fail_if_dead()
            record_memory(result, server, ready)
    except (RuntimeError, TimeoutError, OSError) as exc:
        result.error = str(exc)
    except Exception as exc:  # a failed request (gRPC, the worker's refusal): reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---- llama-server ------------------------------------------------------------------------


KV_LOG_LINE = re.compile(r"KV buffer size\s*=\s*([\d.]+)\s*MiB")


def llama_server_kv_mib(log_text: str) -> float:
    """The KV bytes llama-server allocated, from its log (a sliding-window model logs two
    caches: the sum)."""
    sizes = [float(m.group(1)) for m in KV_LOG_LINE.finditer(log_text)]
    return sum(sizes) if sizes else math.nan


def llama_server_command(
    server: Path, model: Path, port: int, context: int, slots: int, threads: int
) -> list[str]:
    return [
        str(server),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-c",
        str(context),
        "-np",
        str(slots),
        "--cache-ram",
        "0",
        # Log level 4: the KV cache's size lines (llama_kv_cache: ... KV buffer size), which
        # the default level leaves out.
        "-lv",
        "4",
    ]


def http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False  # 503 while loading, refused before the socket is bound


def llama_server_request(base_url: str, prompt: list[int], output_len: int) -> int:
    body = {
        "prompt": prompt,
        "n_predict": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    request = urllib.request.Request(
        base_url + "/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        answer = json.loads(response.read())
    return int(answer.get("tokens_predicted", 0))


def measure_llama_server(
    server_binary: Path, model: Path, args: argparse.Namespace
) -> EngineMemory:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = llama_server_command(
        server_binary, model, port, args.context, args.slots, args.threads
    )
    result = EngineMemory("llama-server", command)
    log_path = Path(args.out_dir) / f"{model.stem}.llama-server.log"
    result.log = str(log_path)
    try:
        with Measured(command, log_path, os.environ) as server:
            result.ready_s = server.wait_ready(
                lambda: http_ready(base_url + "/health"), args.startup_timeout
            )
            ready = server.status()
            prompt = random_prompts(1, args.prompt_len, seed=args.seed)[0]
            result.generated_tokens = llama_server_request(base_url, prompt, args.output_len)
            time.sleep(SETTLE_S)
            server.fail_if_dead()
            record_memory(result, server, ready)
            result.kv_mib = llama_server_kv_mib(log_path.read_text(errors="replace"))
            result.kv_tokens = args.context
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        result.error = str(exc)
    return result


# ---- the command -------------------------------------------------------------------------


def resolve_models(text: str) -> list[tuple[str, Path]]:
    """--models entries: 'embedded', a .gguf path, or a built shape 'NAME[:TYPE]'."""
    from benchmarks.model_shapes import SHAPES, built_file
    from services.common.model_source import resolve_model_path

    models = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.partition(":")[0] in SHAPES:
            models.append((item, built_file(item)))
        else:
            path = resolve_model_path(item)
            if path.suffix != ".gguf":
                raise ValueError(f"{item}: llama-server needs a .gguf file")
            models.append((path.name, path))
    if not models:
        raise ValueError("--models: no file given")
    return models


def llama_server_binary() -> Path:
    from benchmarks.llamacpp_build import PeerBinaries, cache_dir

    binary = PeerBinaries(cache_dir() / "bin").server
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"llama-server is not built ({binary}): run {BUILD_HINT}")
    return binary


def settings_line(args: argparse.Namespace) -> str:
    return (
        f"context {args.context} tokens of f16 KV for both, {args.slots} slots"
        f" (llama-server -np, llmserve --max-num-seqs), {args.threads} threads; one request of"
        f" {args.prompt_len} prompt + {args.output_len} generated tokens before the steady"
        " reading; one process at a time, the file in the page cache before each start"
    )


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the servers started are stopped on the way out."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    try:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        if not engines or [e for e in engines if e not in ENGINES]:
            raise ValueError(f"--engines: some of {', '.join(ENGINES)}")
        if min(args.context, args.slots, args.threads, args.prompt_len, args.output_len) < 1:
            raise ValueError("--context, --slots, --threads and the lengths must be positive")
        models = resolve_models(args.models)
        server_binary = llama_server_binary() if "llama-server" in engines else None
    except (ValueError, OSError) as exc:
        print(f"bench memory: {exc}", file=sys.stderr)
        return 2
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    load_at_start = load_average()
    header = "\n".join(
        [
            f"command: `{command_line()}`",
            f"cpu: {cpu_model_name()} ({os.cpu_count()} logical cores); {load_at_start}",
            f"cpu flags: {' '.join(cpu_simd_flags()) or 'unknown'}",
            settings_line(args),
        ]
    )
    print(header + "\n", flush=True)
    files: list[FileMemory] = []
    with terminate_as_interrupt():
        for label, path in models:
            geometry = kv_geometry(read_gguf_metadata(path))
            kv_bytes = geometry.cache_bytes(args.context)
            entry = FileMemory(label, str(path), path.stat().st_size / MiB, kv_bytes)
            print(
                f"# {label} ({path}): KV {kv_bytes / MiB:.0f} MiB"
                f" = {args.context} tokens x {geometry.bytes_per_token()} B",
                flush=True,
            )
            for engine in engines:
                warm_page_cache(path)
                if engine == "llmserve":
                    measured = measure_llmserve(path, kv_bytes, args)
                else:
                    assert server_binary is not None
                    measured = measure_llama_server(server_binary, path, args)
                entry.engines[engine] = measured
                verdict = measured.error or (
                    f"ready in {measured.ready_s:.1f} s, peak {measured.peak_mib:.0f} MiB,"
                    f" steady {measured.steady_rss_mib:.0f} MiB"
                )
                print(f"-> {engine}: {verdict}", flush=True)
            files.append(entry)
    table = memory_table(files)
    problems = [
        f"{entry.label} {name}: {result.error}"
        for entry in files
        for name, result in entry.engines.items()
        if result.error
    ]
    notes = tree_notes(files)
    listed = "".join(f"\n- {line}" for line in notes) + "".join(
        f"\n- problem: {line}" for line in problems
    )
    print("\n" + header + "\n\n" + table + (f"\n{listed}" if listed else ""))
    if args.json:
        document = {
            "command": command_line(),
            "cpu": cpu_model_name(),
            "cpu_flags": cpu_simd_flags(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": load_average(),
            "settings": {
                k: getattr(args, k)
                for k in ("context", "slots", "threads", "prompt_len", "output_len", "seed")
            },
            "files": [_json_file(entry) for entry in files],
            "table": table,
            "notes": notes,
            "problems": problems,
        }
        text = json.dumps(document, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            print(f"wrote {args.json}")
    return 1 if problems else 0


def _json_file(entry: FileMemory) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    document = asdict(entry)
    for name, result in entry.engines.items():
        fields = {k: clean(v) for k, v in document["engines"][name].items()}
        fields["peak_over_steady"] = clean(result.peak_over_steady)
        document["engines"][name] = fields
    return {k: clean(v) for k, v in document.items()}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default="embedded",
        help="comma-separated: 'embedded', .gguf paths, or built shapes like llama-3.2-1b:Q4_K_M"
        " (python -m benchmarks.model_shapes list)",
    )
    parser.add_argument("--context", type=int, default=8192, help="KV capacity in tokens")
    parser.add_argument("--slots", type=int, default=16, help="parallel sequences")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"some of {', '.join(ENGINES)}"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, help="seconds per start"
    )
    parser.add_argument("--out-dir", default="bench-results/memory", help="the servers' logs")
    parser.add_argument("--json", default=None, help="write the results as JSON here (- : stdout)")
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "memory",
        help="RSS and start-up time: the llmserve worker vs llama-server, same file and KV",
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
