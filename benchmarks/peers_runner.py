"""The processes of `llmserve bench peers`: llama-server in its own process group, one
engine's workloads run one after another (a server lives only for the serving workloads), each
run's commands, output files and measures kept. What to run comes from compare.py."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.compare import (
    SERVE_WORKLOADS,
    EngineSpec,
    PeersConfig,
    batched_bench_command,
    batched_bench_measures,
    llama_bench_command,
    llama_bench_measures,
    llama_server_command,
    offline_command,
    offline_measures,
    parse_batched_bench,
    parse_llama_bench,
    serve_checks,
    serve_command,
    serve_measures,
    stack_flags,
)
from benchmarks.llamacpp_build import PeerBinaries

SERVER_STARTUP_TIMEOUT_S = 300.0


@dataclass(slots=True)
class WorkloadRun:
    """One workload on one engine: what ran, what it measured, what looked wrong."""

    workload: str
    commands: list[list[str]] = field(default_factory=list)
    exit_code: int | None = None
    output: str | None = None
    """The tool's raw output file (JSON, JSONL or text)."""
    measures: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    elapsed_s: float = 0.0


# ---- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """llama-server in its own process group, logging to a file; ready when /health says so."""

    def __init__(self, command: list[str], port: int, log_path: Path) -> None:
        self.command = command
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            self.fail_if_dead()
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass  # 503 while the model loads, refused before the socket is bound
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"llama-server not ready after {SERVER_STARTUP_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail_if_dead(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"llama-server exited with {self.process.returncode}; see {self.log_path}"
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


def run_command(command: list[str], stdout_path: Path | None, stderr_path: Path | None) -> int:
    """Run to completion; each stream to its file, or to the terminal when None (so our own
    benchmarks' progress bars and tables show while they run)."""
    print(f"$ {shlex.join(command)}", flush=True)
    with contextlib.ExitStack() as files:
        stdout = files.enter_context(stdout_path.open("wb")) if stdout_path else None
        stderr = files.enter_context(stderr_path.open("wb")) if stderr_path else None
        return subprocess.call(command, stdout=stdout, stderr=stderr)


# ---- one engine --------------------------------------------------------------------------


@dataclass(slots=True)
class Runner:
    config: PeersConfig
    workloads: list[str]
    out_dir: Path
    binaries: PeerBinaries | None
    python: str = sys.executable

    def path(self, engine: EngineSpec, workload: str, suffix: str) -> Path:
        return self.out_dir / f"{engine.name}-{workload}{suffix}"

    def serve(self, engine: EngineSpec, target: str, workload: str) -> WorkloadRun:
        run = WorkloadRun(workload)
        out = self.path(engine, workload, ".json")
        out.unlink(missing_ok=True)  # never read an earlier run's file
        command = serve_command(self.python, engine, target, self.config, workload, out)
        run.commands.append(command)
        run.exit_code = run_command(command, None, None)
        if not out.exists():
            run.error = f"bench serve wrote no {out.name} (exit {run.exit_code})"
            return run
        run.output = str(out)
        document = json.loads(out.read_text())
        run.measures = serve_measures(document, workload)
        run.warnings = serve_checks(document, self.config)
        return run

    def llmserve_offline(self, engine: EngineSpec, workload: str) -> WorkloadRun:
        run = WorkloadRun(workload)
        out = self.path(engine, workload, ".json")
        out.unlink(missing_ok=True)
        command = offline_command(self.python, engine, self.config, workload, out)
        run.commands.append(command)
        text = self.path(engine, workload, ".txt")
        run.exit_code = run_command(command, text, None)
        if not out.exists():
            run.error = f"bench offline wrote no {out.name} (exit {run.exit_code}); see {text}"
            return run
        run.output = str(out)
        run.measures = offline_measures(json.loads(out.read_text()), self.config, workload)
        return run

    def llamacpp_tool(self, engine: EngineSpec, workload: str) -> WorkloadRun:
        """c: llama-batched-bench, d: llama-bench; their stdout is parsed."""
        assert self.binaries is not None
        run = WorkloadRun(workload)
        out = self.path(engine, workload, ".out")
        if workload == "c":
            command = batched_bench_command(self.binaries.batched_bench, engine.model, self.config)
        else:
            command = llama_bench_command(self.binaries.bench, engine.model, self.config)
        run.commands.append(command)
        log = self.path(engine, workload, ".log")
        run.exit_code = run_command(command, out, log)
        run.output = str(out)
        # llama-batched-bench logs its rows; read both streams so neither placement is missed.
        text = out.read_text(errors="replace") + "\n" + log.read_text(errors="replace")
        if workload == "c":
            run.measures = batched_bench_measures(parse_batched_bench(text), self.config)
        else:
            run.measures = llama_bench_measures(parse_llama_bench(text), self.config)
        if not run.measures:
            run.error = f"no result for this shape in {out.name} (exit {run.exit_code}); see {log}"
        return run

    def run_engine(self, engine: EngineSpec) -> dict[str, WorkloadRun]:
        """Every chosen workload on one engine. A server (llama-server or the stack) lives
        for the serving workloads only and is gone before the offline ones start."""
        workloads = [w for w in self.workloads if engine.runs(w)]
        serving = [w for w in workloads if w in SERVE_WORKLOADS]
        runs: dict[str, WorkloadRun] = {}
        if serving and engine.kind == "llamacpp":
            runs.update(self.serve_llama_server(engine, serving))
        elif serving and engine.kind == "llmserve-stack":
            runs.update(self.serve_stack(engine, serving))
        elif serving:
            for workload in serving:
                runs[workload] = self.timed(workload, self.serve, engine, "inprocess")
        for workload in workloads:
            if workload in SERVE_WORKLOADS:
                continue
            if engine.kind == "llamacpp":
                runs[workload] = self.timed(workload, self.llamacpp_tool, engine)
            else:
                runs[workload] = self.timed(workload, self.llmserve_offline, engine)
        return {w: runs[w] for w in workloads if w in runs}

    def serve_llama_server(self, engine: EngineSpec, serving: list[str]) -> dict[str, WorkloadRun]:
        assert self.binaries is not None
        port = free_port()
        command = llama_server_command(self.binaries.server, engine.model, port, self.config)
        print(f"$ {shlex.join(command)}", flush=True)
        log = self.out_dir / f"{engine.name}-server.log"
        runs: dict[str, WorkloadRun] = {}
        try:
            with LlamaServer(command, port, log) as server:
                for workload in serving:
                    target = server.base_url + "/v1"
                    runs[workload] = self.timed(workload, self.serve, engine, target)
                    runs[workload].commands.insert(0, command)
                    server.fail_if_dead()
        except (RuntimeError, TimeoutError, OSError) as exc:
            for workload in serving:
                runs.setdefault(workload, WorkloadRun(workload, [command], error=str(exc)))
        return runs

    def serve_stack(self, engine: EngineSpec, serving: list[str]) -> dict[str, WorkloadRun]:
        from services.stack import running_stack

        flags = stack_flags(engine, self.config)
        print(f"$ llmserve up {shlex.join(flags)}", flush=True)
        runs: dict[str, WorkloadRun] = {}
        try:
            with running_stack(flags, stderr=subprocess.DEVNULL) as stack:
                for workload in serving:
                    target = f"grpc://{stack.public}"
                    runs[workload] = self.timed(workload, self.serve, engine, target)
        except (RuntimeError, TimeoutError, OSError) as exc:
            for workload in serving:
                runs.setdefault(workload, WorkloadRun(workload, error=str(exc)))
        return runs

    @staticmethod
    def timed(
        workload: str, work: Callable[..., WorkloadRun], engine: EngineSpec, *args: str
    ) -> WorkloadRun:
        """`work(engine, *args, workload)`, timed, with a one-line verdict."""
        started = time.monotonic()
        run = work(engine, *args, workload)
        run.elapsed_s = time.monotonic() - started
        status = run.error or ("; ".join(run.warnings) if run.warnings else "ok")
        print(f"-> {engine.title}, workload {workload}: {status} ({run.elapsed_s:.0f} s)\n")
        return run


# ---- what a report keeps of the runs -----------------------------------------------------


def run_engines(runner: Runner, engines: Sequence[EngineSpec]) -> dict[str, dict[str, WorkloadRun]]:
    """Each engine's workloads, one engine after another: only one is ever loaded."""
    results: dict[str, dict[str, WorkloadRun]] = {}
    for engine in engines:
        print(f"# {engine.title} ({engine.model})", flush=True)
        results[engine.name] = runner.run_engine(engine)
    return results


def measured_values(
    results: Mapping[str, Mapping[str, WorkloadRun]],
) -> dict[str, dict[str, float]]:
    """Per engine, every measure its runs took."""
    return {
        name: {key: value for run in runs.values() for key, value in run.measures.items()}
        for name, runs in results.items()
    }


def run_problems(
    engines: Sequence[EngineSpec], results: Mapping[str, Mapping[str, WorkloadRun]]
) -> list[str]:
    """Every error and warning, named by engine and workload."""
    return [
        f"{engine.title} {workload}: {message}"
        for engine in engines
        for workload, run in results[engine.name].items()
        for message in ([run.error] if run.error else []) + run.warnings
    ]


def any_failed(results: Mapping[str, Mapping[str, WorkloadRun]]) -> bool:
    return any(run.error for runs in results.values() for run in runs.values())


def engine_record(engine: EngineSpec) -> dict[str, str]:
    return {
        "name": engine.name,
        "title": engine.title,
        "kind": engine.kind,
        "model": str(engine.model),
        "quantization": engine.quantization,
    }


def json_values(values: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float | None]]:
    """NaN (not measured) as null."""
    return {
        name: {key: (value if math.isfinite(value) else None) for key, value in measured.items()}
        for name, measured in values.items()
    }


def json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
