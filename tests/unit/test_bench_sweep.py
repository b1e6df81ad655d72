"""Sweeps of `bench serve` (rate and concurrency lists, the saturation-relative sweep) and the
latency-throughput plot; the whole command against a fake OpenAI-compatible server."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import serve, serve_points
from benchmarks.serve_metrics import Chunk, RequestRecord, Slo, summarize
from benchmarks.serve_plot import plot_latency_vs_throughput
from benchmarks.sweep import (
    SATURATION_FRACTIONS,
    CurvePoint,
    PointResult,
    SweepPoint,
    curve_points,
    in_load_order,
    parse_concurrencies,
    parse_rates,
    point_seed,
    saturation_rates,
    sweep_points,
    sweep_rows,
)

# The fake OpenAI server of the serve tests, reused here.
from tests.unit.test_bench_serve import FakeOpenAIHandler, openai_url  # noqa: F401

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_rate_lists_accept_inf_and_reject_non_positive_rates() -> None:
    assert parse_rates("1,2.5, 4,inf") == [1.0, 2.5, 4.0, math.inf]
    for bad in ("0", "1,-2", "nan", "fast", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_concurrency_lists_are_positive_integers() -> None:
    assert parse_concurrencies("1,8,32,64") == [1, 8, 32, 64]
    for bad in ("0", "8,x", "2.5", ""):
        with pytest.raises(ValueError):
            parse_concurrencies(bad)


def test_sweep_points_are_concurrency_major() -> None:
    points = sweep_points([1.0, math.inf], [8, 32])
    assert points == [
        SweepPoint(1.0, 8),
        SweepPoint(math.inf, 8),
        SweepPoint(1.0, 32),
        SweepPoint(math.inf, 32),
    ]
    assert [p.label for p in points[:2]] == ["1 req/s, c=8", "c=8"]
    assert SweepPoint(math.inf, None).label == "all at once"


def test_saturation_rates_are_fractions_of_the_measured_rate() -> None:
    assert saturation_rates(10.0) == [2.5, 5.0, 7.5, 9.0]
    assert saturation_rates(1 / 3, fractions=(0.5,)) == [0.167]
    for bad in (0.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite rate"):
            saturation_rates(bad)


def test_each_point_draws_its_own_prompts_but_the_first_keeps_the_seed() -> None:
    assert point_seed(5, 0) == 5
    assert len({point_seed(5, i) for i in range(10)}) == 10


def _result(rate: float, concurrency: int | None, gap_s: float) -> PointResult:
    """Two requests of 3 tokens each: TTFT 2*gap, then one token every gap."""
    records = []
    for start in (0.0, 1.0):
        chunks = [Chunk(start + gap_s * (k + 2), 1) for k in range(3)]
        records.append(
            RequestRecord(start, end_time_s=chunks[-1].time_s, chunks=chunks, output_tokens=3)
        )
    return PointResult(SweepPoint(rate, concurrency), 2, summarize(records, Slo()))


def test_rows_and_curve_points_carry_the_summary_in_milliseconds() -> None:
    result = _result(2.0, 4, gap_s=0.01)
    (row,) = sweep_rows([result])
    assert row[0] == "2 req/s, c=4"
    assert row[1] == "2/2"
    (point,) = curve_points([result])
    assert point.series == ""
    assert point.ttft_p50_ms == pytest.approx(20.0)
    assert point.tpot_p50_ms == pytest.approx(10.0)
    assert point.output_tokens_per_s == pytest.approx(6 / (1.0 + 0.04))


def test_curves_split_by_concurrency_only_when_rate_and_concurrency_both_vary() -> None:
    results = [_result(r, c, 0.01) for c in (8, 2) for r in (math.inf, 1.0)]
    ordered = in_load_order(results)
    assert [(r.point.concurrency, r.point.request_rate) for r in ordered] == [
        (2, 1.0),
        (2, math.inf),
        (8, 1.0),
        (8, math.inf),
    ]
    assert [p.series for p in curve_points(ordered)] == ["c=2", "c=2", "c=8", "c=8"]
    concurrency_only = [_result(math.inf, c, 0.01) for c in (1, 8)]
    assert {p.series for p in curve_points(concurrency_only)} == {""}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_writes_a_png_even_with_missing_tpot(tmp_path: Path) -> None:
    points = [
        CurvePoint("", "c=1", 50.0, 20.0, 30.0, 10.0, 12.0),
        CurvePoint("", "c=8", 300.0, 90.0, 400.0, 25.0, 40.0),
        CurvePoint("", "c=64", 350.0, 2000.0, 9000.0, math.nan, math.nan),
    ]
    path = tmp_path / "curve.png"
    plot_latency_vs_throughput(points, path, "test")
    width, height = _png_size(path)
    assert width > 100 and height > 100


def test_plot_refuses_an_empty_sweep(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_latency_vs_throughput([], tmp_path / "empty.png", "test")


def test_plot_out_without_matplotlib_fails_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    # An unreachable target: the command must stop at the missing package, before any request.
    args = _parse(["--target", "http://127.0.0.1:9/v1", "--plot-out", str(tmp_path / "p.png")])
    assert serve.run(args) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


# ---- the whole command against the fake OpenAI server -------------------------------------


def _parse(argv: list[str]) -> object:
    import argparse

    parser = argparse.ArgumentParser()
    serve.configure_parser(parser)
    return parser.parse_args(argv)


@pytest.fixture
def quiet_progress(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    original = serve_points.run_point

    def run_point(*args: object, **kwargs: object) -> object:
        return original(*args, show_progress=False, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(serve_points, "run_point", run_point)
    yield


def test_concurrency_sweep_writes_one_json_point_per_load_and_a_plot(
    openai_url: str,  # noqa: F811
    tmp_path: Path,
    quiet_progress: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    json_path, plot_path = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = _parse(
        [
            "--target",
            openai_url,
            "--num-prompts",
            "4",
            "--input-len",
            "3",
            "--output-len",
            "5",
            "--concurrency",
            "1,2",
            "--request-rate",
            "1000,inf",
            "--json-out",
            str(json_path),
            "--plot-out",
            str(plot_path),
        ]
    )
    assert serve.run(args) == 0
    document = json.loads(json_path.read_text())
    points = document["points"]
    assert [(p["concurrency"], p["request_rate"]) for p in points] == [
        (1, 1000.0),
        (1, None),
        (2, 1000.0),
        (2, None),
    ]
    assert [p["num_prompts"] for p in points] == [4] * 4
    assert all(p["summary"]["num_completed"] == 4 for p in points)
    assert all(p["summary"]["output_tokens"] == 20 for p in points)
    assert all(len(p["requests"]) == 4 for p in points)
    # Fresh prompts per point: no point repeats another's prompt (a prefix-cache hit).
    assert len(FakeOpenAIHandler.bodies) == 16
    assert len({tuple(body["prompt"]) for body in FakeOpenAIHandler.bodies}) == 16
    assert all(body["min_tokens"] == 5 for body in FakeOpenAIHandler.bodies)
    assert len({p["seed"] for p in points}) == 4
    _png_size(plot_path)
    out = capsys.readouterr().out
    assert "output tok/s" in out and "1000 req/s, c=2" in out


def test_sweep_flag_adds_rates_from_the_saturated_point(
    openai_url: str,  # noqa: F811
    tmp_path: Path,
    quiet_progress: None,
) -> None:
    json_path = tmp_path / "sweep.json"
    args = _parse(
        [
            "--target",
            openai_url,
            "--num-prompts",
            "3",
            "--output-len",
            "2",
            "--sweep",
            "--json-out",
            str(json_path),
        ]
    )
    assert serve.run(args) == 0
    points = json.loads(json_path.read_text())["points"]
    assert points[0]["request_rate"] is None
    saturated = points[0]["summary"]["requests_per_s"]
    assert [p["request_rate"] for p in points[1:]] == saturation_rates(saturated)
    assert len(points) == 1 + len(SATURATION_FRACTIONS)


def test_sweep_flag_refuses_explicit_rates() -> None:
    args = _parse(["--sweep", "--request-rate", "1,2"])
    assert serve.run(args) == 2
