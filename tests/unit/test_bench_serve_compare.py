"""`llmserve bench serve --compare-inprocess` without a model: the stack's `llmserve up` flags
(parsed by the real `up` parser), the rows, ratios and table, and the whole command against a
fake stack (a gRPC servicer on loopback) and a fake in-process engine."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks import serve, serve_points, serve_stack, serve_targets
from benchmarks.serve_clients import InProcessTarget
from benchmarks.serve_compare import (
    COMPARE_HEADERS,
    INPROCESS,
    STACK,
    SystemFigures,
    SystemRow,
    compare_document,
    compare_legend,
    compare_table,
    ratio,
    stack_up_flags,
    system_rows,
)
from benchmarks.serve_metrics import Chunk, RequestRecord, Slo, summarize
from benchmarks.sweep import PointResult, SweepPoint
from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.common.config_flags import add_config_flags, config_from_args
from services.launcher import StackConfig
from tests.unit.test_bench_serve import FakeEngine


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLMSERVE_* variables would change the `up` parser's defaults."""
    for name in [name for name in os.environ if name.startswith("LLMSERVE_")]:
        monkeypatch.delenv(name)


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.configure_parser(parser)
    return parser.parse_args(argv)


def _up(flags: list[str]) -> StackConfig:
    """What `llmserve up` makes of `flags`."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser, StackConfig)
    return config_from_args(StackConfig, parser.parse_args(flags))


# ---- the stack's flags -----------------------------------------------------------------------


def test_unset_settings_leave_the_stacks_defaults() -> None:
    flags = stack_up_flags(
        model=None, dtype="auto", quantization=None, threads=None, max_num_seqs=8
    )
    assert flags == ["--dtype", "auto", "--max-num-seqs", "8"]
    assert _up(flags) == StackConfig(max_num_seqs=8)


def test_stack_gets_the_inprocess_engines_settings() -> None:
    args = _bench_args(
        [
            *("--compare-inprocess", "--model", "/models/m.gguf", "--dtype", "float32"),
            *("--quantization", "none", "--kv-cache-gib", "0.25", "--max-num-seqs", "4"),
            *("--max-num-batched-tokens", "256", "--threads", "2", "--enforce-eager"),
            *("--tokenizer-replicas", "3"),
        ]
    )
    stack = _up(serve_stack.compare_stack_flags(args))
    engine = serve_targets.engine_config(args)
    shared = {f.name for f in fields(StackConfig)} & {f.name for f in fields(engine)}
    assert {"model", "dtype", "quantization", "max_num_seqs", "enforce_eager", "seed"} <= shared
    assert {name: getattr(stack, name) for name in shared} == {
        name: getattr(engine, name) for name in shared
    }
    assert stack.kv_cache_gib == engine.kv_cache_gib
    assert stack.worker_threads == engine.threads == 2
    assert stack.tokenizer_replicas == 3


def test_stack_args_come_last_and_win() -> None:
    # argparse takes a value starting with '--' only when written with '='.
    stack_args = ["--no-redis", "--max-num-seqs=16", "--routing=round_robin"]
    args = _bench_args(
        ["--compare-inprocess", "--max-num-seqs", "4", *(f"--stack-arg={a}" for a in stack_args)]
    )
    flags = serve_stack.compare_stack_flags(args)
    assert flags[-3:] == ["--no-redis", "--max-num-seqs=16", "--routing=round_robin"]
    stack = _up(flags)
    assert (stack.redis, stack.max_num_seqs, stack.routing) == (False, 16, "round_robin")
    assert stack.tokenizer_replicas == 1  # the bench flag's default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare-inprocess", "--target", "inprocess"], "--target is grpc://"),
        (["--compare-inprocess", "--target", "http://h:1/v1"], "--target is grpc://"),
        (["--compare-inprocess", "--target", "grpc://h:1", "--stack-arg=--no-redis"], "here"),
        (["--compare-inprocess", "--tokenizer-replicas", "0"], "--tokenizer-replicas"),
        (["--stack-arg=--no-redis"], "--compare-inprocess"),
    ],
)
def test_flags_that_do_not_fit_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serve_stack.check_compare_flags(_bench_args(argv))


def test_flags_that_fit_pass() -> None:
    for argv in (["--compare-inprocess"], ["--compare-inprocess", "--target", "grpc://h:1"], []):
        serve_stack.check_compare_flags(_bench_args(argv))


# ---- rows, ratios, the table -------------------------------------------------------------------


def test_ratio_is_value_over_reference_and_undefined_without_two_values() -> None:
    assert ratio(12.0, 10.0) == pytest.approx(1.2)
    assert ratio(80.0, 100.0) == pytest.approx(0.8)
    for value, reference in ((math.nan, 1.0), (1.0, math.nan), (0.0, 1.0), (1.0, 0.0)):
        assert math.isnan(ratio(value, reference))


def _result(point: SweepPoint, tpot_ms: float, tokens: int = 4, failed: int = 0) -> PointResult:
    """A point whose requests each took 10 ms to the first token, then `tpot_ms` per token."""
    records = []
    for index in range(2):
        send = float(index)
        chunks = [Chunk(send + 0.010 + i * tpot_ms / 1e3, 1) for i in range(tokens)]
        records.append(RequestRecord(send, chunks[-1].time_s, chunks, 8, tokens))
    records += [RequestRecord(0.0, 0.5, error="UNAVAILABLE") for _ in range(failed)]
    return PointResult(point, len(records), summarize(records, Slo()))


def _figures(tpot_ms: float, ttft_ms: float, tok_s: float) -> SystemFigures:
    return SystemFigures(tok_s, ttft_ms, 2 * ttft_ms, tpot_ms, 2 * tpot_ms, 2, 2)


def test_rows_pair_the_systems_point_by_point_in_load_order_reference_first() -> None:
    c8, c1 = SweepPoint(math.inf, 8), SweepPoint(math.inf, 1)
    stack = [_result(c8, 6.0), _result(c1, 5.0, failed=1)]
    inprocess = [_result(c8, 5.0), _result(c1, 4.0)]
    rows = system_rows({STACK: stack, INPROCESS: inprocess}, INPROCESS)
    assert [(row.point, row.system) for row in rows] == [
        (c1, INPROCESS),
        (c1, STACK),
        (c8, INPROCESS),
        (c8, STACK),
    ]
    reference, stack_c1 = rows[0], rows[1]
    assert reference.tpot_ratio == pytest.approx(1.0)
    assert stack_c1.figures.tpot_p50_ms == pytest.approx(5.0)
    assert stack_c1.reference.tpot_p50_ms == pytest.approx(4.0)
    assert stack_c1.tpot_ratio == pytest.approx(1.25)
    assert stack_c1.ttft_ratio == pytest.approx(1.0)
    assert (stack_c1.figures.num_completed, stack_c1.figures.num_requests) == (2, 3)
    assert stack_c1.figures.errors == {"UNAVAILABLE": 1}


def test_rows_stop_where_one_system_stopped_and_refuse_different_loads() -> None:
    c1, c2 = SweepPoint(math.inf, 1), SweepPoint(math.inf, 2)
    results = {"a": [_result(c1, 4.0), _result(c2, 4.0)], "b": [_result(c1, 5.0)]}
    assert {row.point for row in system_rows(results, "a")} == {c1}
    with pytest.raises(ValueError, match="different loads"):
        system_rows({"a": [_result(c1, 4.0)], "b": [_result(c2, 4.0)]}, "a")


def test_rounds_give_medians_of_figures_and_sums_of_counts() -> None:
    c1 = SweepPoint(math.inf, 1)
    rounds = [_result(c1, 4.0), _result(c1, 10.0, failed=1), _result(c1, 5.0)]
    (row,) = system_rows({"a": rounds}, "a")
    assert row.figures.tpot_p50_ms == pytest.approx(5.0)
    assert row.figures.num_rounds == 3
    assert (row.figures.num_completed, row.figures.num_requests) == (6, 7)
    assert row.figures.errors == {"UNAVAILABLE": 1}
    # A round whose requests all failed has no figures: the median is over the others.
    failed = PointResult(c1, 1, summarize([RequestRecord(0.0, 0.1, error="HTTP 401")]))
    (row,) = system_rows({"a": [_result(c1, 4.0), failed]}, "a")
    assert row.figures.tpot_p50_ms == pytest.approx(4.0)
    assert row.figures.errors == {"HTTP 401": 1}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_table_has_a_row_per_system_with_its_ratios_to_the_reference() -> None:
    c1, rate2 = SweepPoint(math.inf, 1), SweepPoint(2.0, None)
    reference = _figures(10.0, 20.0, 100.0)
    failed = SystemFigures(0.0, math.nan, math.nan, math.nan, math.nan, 0, 2, {"HTTP 401": 2})
    rows = [
        SystemRow(c1, "in", reference, reference),
        SystemRow(c1, "out", _figures(12.5, 30.0, 80.0), reference),
        SystemRow(rate2, "out", failed, reference),
    ]
    lines = compare_table(rows, "in").splitlines()
    assert _cells(lines[0]) == COMPARE_HEADERS
    assert _cells(lines[2]) == [
        *("c=1", "in", "2/2", "0"),
        *("100.0", "1.00", "20.0", "40.0", "1.00", "10.0", "1.00", "-"),
    ]
    assert _cells(lines[3]) == [
        *("c=1", "out", "2/2", "0"),
        *("80.0", "0.80", "30.0", "60.0", "1.50", "12.5", "1.25", "-"),
    ]
    assert _cells(lines[4])[:6] == ["2 req/s", "out", "0/2", "HTTP 401: 2", "0.00", "-"]
    assert lines[-1] == compare_legend("in")
    assert "/ in at the same load" in lines[-1]
    assert "lower is better" in lines[-1] and "higher is better" in lines[-1]
    assert "medians over 3 rounds" in compare_legend("in", 3)


def test_json_section_holds_every_system_and_the_ratios() -> None:
    c1 = SweepPoint(math.inf, 1)
    reference = _figures(10.0, 20.0, 100.0)
    rows = [
        SystemRow(c1, INPROCESS, reference, reference),
        SystemRow(c1, STACK, _figures(11, 22, 90.0), reference),
    ]
    targets = {"stack": "grpc://h:1 (1 channels)", "inprocess": "inprocess (m, f32)"}
    command = ["llmserve", "up", "--dtype", "auto"]
    document = compare_document(rows, targets, INPROCESS, command)
    assert document["reference"] == "inprocess"
    assert document["run_order"] == ["stack", "inprocess"]
    assert document["stack_command"] == ["llmserve", "up", "--dtype", "auto"]
    assert document["rounds"] == 1
    written_reference, written = document["rows"]
    assert written["label"] == "c=1" and written["concurrency"] == 1
    assert written_reference["target"] == "inprocess" and written["target"] == "stack"
    assert written_reference["tpot_p50_ms"] == 10.0 and written["ttft_p50_ms"] == 22
    assert written["over_reference"] == pytest.approx(
        {"tpot_p50": 1.1, "ttft_p50": 1.1, "output_tokens_per_s": 0.9}
    )


# ---- the whole command against a fake stack and a fake engine --------------------------------


class RecordingTextGeneration(text_pb2_grpc.TextGenerationServicer):  # type: ignore[misc]
    """One token per message; remembers every prompt and the events list's length then."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.prompts: list[tuple[int, ...]] = []

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        self.prompts.append(tuple(request.prompt_token_ids))
        self.events.append("stack request")
        n = request.sampling.max_new_tokens
        for index in range(n):
            yield text_pb2.GenerateResponse(token_ids=[index])
        usage = text_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=n)
        yield text_pb2.GenerateResponse(finish_reason="length", usage=usage)


@dataclass
class RecordingEngine(FakeEngine):
    prompts: list[tuple[int, ...]] | None = None

    def add_request(self, prompt: Any, sampling: Any) -> str:
        assert self.prompts is not None
        self.prompts.append(tuple(prompt))
        return super().add_request(prompt, sampling)


@dataclass
class FakeSystems:
    events: list[str]
    servicer: RecordingTextGeneration
    address: str
    engine: RecordingEngine
    up_flags: list[list[str]]


@pytest.fixture
def fake_systems(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSystems]:
    events: list[str] = []
    servicer = RecordingTextGeneration(events)
    server = grpc.server(ThreadPoolExecutor(4))
    text_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    engine = RecordingEngine(prompts=[])
    systems = FakeSystems(events, servicer, f"127.0.0.1:{port}", engine, [])

    @dataclass
    class Started:
        public: str
        returncode: int | None = None
        info: dict[str, object] = field(default_factory=lambda: {"pids": {}})

    @contextmanager
    def running_stack(
        flags: list[str], startup_timeout_s: float, stderr: object
    ) -> Iterator[Started]:
        assert isinstance(startup_timeout_s, float) and startup_timeout_s > 0
        systems.up_flags.append(flags)
        events.append("stack started")
        started = Started(systems.address)
        try:
            yield started
        finally:
            started.returncode = 0
            events.append("stack stopped")

    def inprocess_target(config: object, generation: Any) -> InProcessTarget:
        events.append("engine loaded")
        return InProcessTarget(engine, generation)

    monkeypatch.setattr("services.stack.running_stack", running_stack)
    monkeypatch.setattr(serve, "inprocess_target", inprocess_target)
    original = serve_points.run_point

    def quiet_run_point(*args: object, **kwargs: object) -> object:
        return original(*args, show_progress=False, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(serve_points, "run_point", quiet_run_point)
    yield systems
    server.stop(None)


def test_compare_runs_the_stack_then_the_engine_on_the_same_samples(
    fake_systems: FakeSystems, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare.json"
    argv = ["--compare-inprocess", "--num-prompts", "3", "--input-len", "5", "--output-len", "4"]
    argv += ["--concurrency", "1,2", "--warmup", "2", "--json-out", str(out)]
    argv += ["--stack-arg=--no-redis", "--tokenizer-replicas", "2"]
    assert serve.run(_bench_args(argv)) == 0
    events = fake_systems.events
    # One system at a time: the stack is stopped before the engine loads.
    assert events[0] == "stack started"
    assert events.index("stack stopped") == len(events) - 2 and events[-1] == "engine loaded"
    (flags,) = fake_systems.up_flags
    assert flags[-3:] == ["--tokenizer-replicas", "2", "--no-redis"]
    # The same warm-up and the same prompts on both systems: in the same order while one
    # request is in flight (warm-up and c=1); at c=2 two requests race to the server.
    engine, stack = fake_systems.engine.prompts, fake_systems.servicer.prompts
    assert len(stack) == 2 + 2 * 3
    assert engine[:5] == stack[:5] and sorted(engine[5:]) == sorted(stack[5:])
    report = capsys.readouterr().out
    assert "llmserve up stopped: exit 0" in report
    table = report[report.index("## in-process vs stack") :].splitlines()
    assert _cells(table[2])[:3] == ["load", "target", "requests ok"]
    assert [_cells(line)[:3] for line in table[4:8]] == [
        ["c=1", "inprocess", "3/3"],
        ["c=1", "stack", "3/3"],
        ["c=2", "inprocess", "3/3"],
        ["c=2", "stack", "3/3"],
    ]
    assert table[8] == compare_legend("inprocess")
    document = json.loads(out.read_text())
    assert [(p["system"], p["concurrency"]) for p in document["points"]] == [
        ("stack", 1),
        ("stack", 2),
        ("inprocess", 1),
        ("inprocess", 2),
    ]
    compare = document["compare"]
    assert compare["stack_command"] == ["llmserve", "up", *flags]
    assert compare["reference"] == "inprocess"
    assert [(row["label"], row["target"]) for row in compare["rows"]] == [
        ("c=1", "inprocess"),
        ("c=1", "stack"),
        ("c=2", "inprocess"),
        ("c=2", "stack"),
    ]
    for row in compare["rows"]:
        assert row["output_tokens_per_s"] > 0 and row["tpot_p50_ms"] > 0
        assert row["over_reference"]["output_tokens_per_s"] > 0


def test_compare_with_a_running_stack_starts_none(
    fake_systems: FakeSystems, tmp_path: Path
) -> None:
    out = tmp_path / "compare.json"
    argv = ["--compare-inprocess", "--target", f"grpc://{fake_systems.address}"]
    argv += ["--num-prompts", "2", "--output-len", "3", "--json-out", str(out)]
    assert serve.run(_bench_args(argv)) == 0
    assert fake_systems.up_flags == []
    assert fake_systems.events[-1] == "engine loaded"
    compare = json.loads(out.read_text())["compare"]
    assert compare["stack_command"] is None
    assert compare["targets"]["stack"].startswith(f"grpc://{fake_systems.address}")


def test_compare_stops_when_the_stack_does_not_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @contextmanager
    def failing_stack(flags: list[str], **kwargs: Any) -> Iterator[None]:
        kwargs["stderr"].write(b"worker: out of memory\n")
        raise RuntimeError("llmserve up exited with 1")
        yield

    def no_engine(config: object, generation: object) -> None:
        raise AssertionError("the engine must not load after the stack failed")

    monkeypatch.setattr("services.stack.running_stack", failing_stack)
    monkeypatch.setattr(serve, "inprocess_target", no_engine)
    assert serve.run(_bench_args(["--compare-inprocess", "--num-prompts", "1"])) == 1
    err = capsys.readouterr().err
    assert "llmserve up exited with 1" in err and "worker: out of memory" in err
