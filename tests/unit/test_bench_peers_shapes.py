"""`bench peers --shapes` without running an engine: the SPEC of real-size files and its errors,
the columns of a file's table (every one on that file), what a file's weights cost per token,
the roofs (int8 peak per CPU flag set, % of bandwidth and of peak) and the table itself."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks import peers, peers_shapes
from benchmarks.compare import PeersConfig
from benchmarks.machine_peaks import (
    MachinePeaks,
    int8_path,
    int8_peak_ops_per_s,
    measure,
    parse_cpu_mhz,
)
from benchmarks.model_shapes import SHAPES
from benchmarks.peers_table import measures
from benchmarks.shapes_table import (
    RATIO_HEADER,
    FileWeights,
    ShapeRef,
    bandwidth_percent,
    file_engines,
    file_weights,
    int8_percent,
    parse_shapes_spec,
    roof_of,
    roof_percent,
    shape_table,
)
from services.common.gguf_index import GGUFTensor

GB = 1e9
FILE = Path("/cache/shapes/llama-3.2-1b/llama-3.2-1b.Q4_K_M.gguf")


def _peaks(
    flags: tuple[str, ...] = ("avx2", "avx512_vnni"),
    read_bytes_per_s: float = 50 * GB,
    clock_mhz: float = 2500.0,
    cores: int = 2,
) -> MachinePeaks:
    return MachinePeaks(
        read_bytes_per_s=read_bytes_per_s,
        buffer_bytes=512 << 20,
        budget_s=0.5,
        threads=cores,
        cores=cores,
        clock_mhz=clock_mhz,
        flags=flags,
    )


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


# ---- SPEC ------------------------------------------------------------------------------------


def test_spec_names_shapes_and_types_with_q4_k_m_by_default() -> None:
    refs = parse_shapes_spec(
        "llama-3.2-1b:Q4_K_M, llama-3.2-1b:q4_0,llama-3.2-3b,qwen2.5-1.5b:Q4_K_M,,llama-3.2-1b"
    )
    assert [r.label for r in refs] == [
        "llama-3.2-1b:Q4_K_M",
        "llama-3.2-1b:Q4_0",
        "llama-3.2-3b:Q4_K_M",
        "qwen2.5-1.5b:Q4_K_M",
    ]  # the last item repeats the first: dropped
    assert refs[0].shape is SHAPES["llama-3.2-1b"]
    assert refs[1].slug == "llama-3.2-1b.Q4_0"
    assert [r.label for r in parse_shapes_spec("llama-3.1-8b")] == ["llama-3.1-8b:Q4_K_M"]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("llama-3.2-1b,llama-9b:Q4_K_M", "unknown shape 'llama-9b' in 'llama-9b:Q4_K_M'"),
        ("llama-3.2-1b:Q4_K_M,llama-3.2-3b:Q3_K", "unknown type 'Q3_K' in 'llama-3.2-3b:Q3_K'"),
        # The 8B file is written directly, as Q4_K_M only.
        ("llama-3.1-8b:Q4_0", "unknown type 'Q4_0' in 'llama-3.1-8b:Q4_0'"),
        (" , ", "no file named"),
    ],
)
def test_spec_errors_name_the_bad_item(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match="--shapes") as error:
        parse_shapes_spec(spec)
    assert named in str(error.value)


def test_spec_errors_list_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"known: llama-3\.2-1b, llama-3\.2-3b"):
        parse_shapes_spec("mistral-7b")
    with pytest.raises(ValueError, match=r"llama-3\.1-8b is built as Q4_K_M$"):
        parse_shapes_spec("llama-3.1-8b:Q8_0")


def test_the_command_refuses_a_bad_spec_and_other_files_before_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert peers.main(["--shapes", "llama-3.2-1b:Q2_K"]) == 2
    assert "unknown type 'Q2_K' in 'llama-3.2-1b:Q2_K'" in capsys.readouterr().err
    assert peers.main(["--shapes", "llama-3.2-1b", "--llmserve-files", "Q4_0"]) == 2
    assert "leave out --model and --llmserve-files" in capsys.readouterr().err


def test_a_missing_file_is_built_once_and_a_cached_one_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = tmp_path / "llama-3.2-1b.Q4_0.gguf"
    cached.write_bytes(b"GGUF")
    missing = tmp_path / "llama-3.2-3b.Q4_K_M.gguf"
    built: list[tuple[str, list[str]]] = []

    def build(shape: object, types: list[str]) -> dict[str, Path]:
        built.append((shape.name, types))  # type: ignore[attr-defined]
        return {types[0]: missing}

    monkeypatch.setattr(
        peers_shapes,
        "shape_file",
        lambda shape, quant_type: tmp_path / f"{shape.name}.{quant_type}.gguf",
    )
    monkeypatch.setattr(peers_shapes, "build", build)
    refs = parse_shapes_spec("llama-3.2-1b:Q4_0,llama-3.2-3b")
    paths = peers_shapes.ensure_shape_files(refs)
    assert paths == {"llama-3.2-1b:Q4_0": cached, "llama-3.2-3b:Q4_K_M": missing}
    assert built == [("llama-3.2-3b", ["Q4_K_M"])]


# ---- the columns of one file -----------------------------------------------------------------


def test_both_engines_load_the_same_file() -> None:
    ref = ShapeRef(SHAPES["llama-3.2-1b"], "Q4_K_M")
    engines = file_engines(ref, FILE, True, ["auto", "none"], ["auto"])
    assert [e.name for e in engines] == [
        "llamacpp-q4_k_m",
        "llmserve-auto",
        "llmserve-none",
        "llmserve-stack-auto",
    ]
    assert {e.model for e in engines} == {FILE}
    assert [e.title for e in engines][:2] == ["llama.cpp Q4_K_M", "llmserve auto"]
    assert [e.name for e in file_engines(ref, FILE, False, ["auto"])] == ["llmserve-auto"]
    assert [e.name for e in file_engines(ref, FILE, True, [])] == ["llamacpp-q4_k_m"]


# ---- the weights -----------------------------------------------------------------------------


def _tensor(name: str, shape: tuple[int, ...], num_bytes: int) -> GGUFTensor:
    return GGUFTensor(name, shape, 12, 0, num_bytes)


def test_a_tied_file_reads_every_tensor_per_token() -> None:
    tensors = [
        _tensor("token_embd.weight", (1000, 64), 40_000),
        _tensor("blk.0.attn_q.weight", (64, 64), 2_000),
        _tensor("output_norm.weight", (64,), 256),
    ]
    weights = file_weights(tensors)
    assert weights == FileWeights(64_000 + 4_096 + 64, 42_256)


def test_an_untied_file_looks_its_embeddings_up_instead_of_reading_them() -> None:
    tensors = [
        _tensor("token_embd.weight", (1000, 64), 40_000),
        _tensor("blk.0.ffn_up.weight", (128, 64), 4_000),
        _tensor("output.weight", (1000, 64), 50_000),
    ]
    assert file_weights(tensors) == FileWeights(8_192 + 64_000, 54_000)


# ---- the roofs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "ops_per_cycle", "instructions"),
    [
        (("avx2", "avx512bw", "avx512_vnni", "avx_vnni"), 256, "AVX-512 VNNI vpdpbusd zmm"),
        (("avx2", "avx_vnni"), 128, "AVX-VNNI vpdpbusd ymm"),  # Alder Lake: VNNI on ymm only
        (("avx2", "avx512bw"), 128, "AVX-512BW vpmaddubsw + vpmaddwd zmm"),  # Skylake-SP
        (("avx", "avx2", "fma"), 64, "AVX2 vpmaddubsw + vpmaddwd ymm"),
        (("avx512_vnni", "amx_int8", "amx_tile"), 2048, "AMX tdpbusd"),  # Sapphire Rapids
    ],
)
def test_int8_peak_per_flag_set(
    flags: tuple[str, ...], ops_per_cycle: int, instructions: str
) -> None:
    path = int8_path(flags)
    assert path is not None and path.instructions == instructions
    assert path.ops_per_cycle == ops_per_cycle
    # ops/cycle/core x clock x cores
    assert int8_peak_ops_per_s(path, 2500.0, 2) == ops_per_cycle * 2.5e9 * 2
    assert _peaks(flags).int8_ops_per_s == ops_per_cycle * 2.5e9 * 2


def test_int8_peak_is_unknown_without_an_int8_path_or_a_clock() -> None:
    assert int8_path(("sse4_1", "sse4_2", "avx")) is None
    assert math.isnan(_peaks(("avx",)).int8_ops_per_s)
    assert "unknown" in _peaks(("avx",)).int8_line()
    assert math.isnan(_peaks(clock_mhz=math.nan).int8_ops_per_s)


def test_the_peak_line_states_its_formula() -> None:
    line = _peaks().int8_line()
    assert line.startswith(
        "int8 peak: 1280 GOPS = 2 ops x 64 MACs (AVX-512 VNNI vpdpbusd zmm) x 2 per cycle x"
        " 2500 MHz x 2 cores"
    )
    assert "1/16 per cycle" in _peaks(("amx_int8",)).int8_line()
    assert _peaks().bandwidth_line().startswith("memory bandwidth: 50.0 GB/s read")


def test_cpu_clock_is_read_for_every_core() -> None:
    cpuinfo = (
        "processor\t: 0\ncpu MHz\t\t: 2596.122\nflags\t\t: avx2\n\n"
        "processor\t: 1\ncpu MHz\t\t: 3100.5\nflags\t\t: avx2\n"
    )
    assert parse_cpu_mhz(cpuinfo) == [2596.122, 3100.5]
    assert parse_cpu_mhz("processor : 0\n") == []


def test_peaks_survive_their_json_with_an_unknown_clock() -> None:
    peaks = _peaks(clock_mhz=math.nan)
    document = peaks.to_json()
    assert document["clock_mhz"] is None and document["int8_ops_per_s"] is None
    again = MachinePeaks.from_json(document)
    assert math.isnan(again.clock_mhz) and again.flags == peaks.flags
    assert MachinePeaks.from_json(_peaks().to_json()) == _peaks()


def test_a_measured_int8_peak_wins_over_the_formula_and_names_its_instruction() -> None:
    formula = _peaks()
    measured = dataclasses.replace(formula, measured_int8=(1.0e12, 2.2e12, math.nan))
    assert measured.int8_ops_per_s == 2.2e12
    line = measured.int8_line()
    assert line.startswith("int8 peak: 2200 GOPS measured (vpdpbusd zmm")
    assert "vpdpbusd ymm 1000" in line and "vpmaddubsw" not in line
    again = MachinePeaks.from_json(json.loads(json.dumps(measured.to_json())))
    assert again.measured_int8[:2] == (1.0e12, 2.2e12) and math.isnan(again.measured_int8[2])
    # Nothing measured (the extension did not load): the formula, as before.
    nothing = dataclasses.replace(formula, measured_int8=(math.nan, math.nan, math.nan))
    assert nothing.int8_ops_per_s == formula.int8_ops_per_s
    assert "measured" not in nothing.int8_line()


def test_the_measurement_reads_a_buffer_and_the_clock() -> None:
    # A function check, not a figure (the int8 chains: tests/kernels/test_int8_peak.py).
    peaks = measure(threads=1, buffer_mib=1, budget_s=0.01, with_int8_peak=False)
    assert peaks.read_bytes_per_s > 0 and peaks.buffer_bytes == 1 << 20
    assert peaks.threads == peaks.cores == 1
    with pytest.raises(ValueError):
        measure(threads=0)


def test_bandwidth_and_peak_percentages() -> None:
    # 25 tok/s x 1 GB per token = 25 GB/s of 50 GB/s read.
    assert bandwidth_percent(25.0, 10**9, 50 * GB) == pytest.approx(50.0)
    # 2 x 1e9 params x 100 tok/s = 200 GOPS of 2560 GOPS.
    assert int8_percent(100.0, 10**9, 2560 * GB) == pytest.approx(100 * 200 / 2560)
    for bad in (math.nan, 0.0, -1.0):
        assert math.isnan(bandwidth_percent(bad, 10**9, 50 * GB))
        assert math.isnan(bandwidth_percent(25.0, 10**9, bad))
        assert math.isnan(int8_percent(bad, 10**9, 2560 * GB))
        assert math.isnan(int8_percent(100.0, 10**9, bad))


def test_each_row_meets_its_roof() -> None:
    weights = FileWeights(num_params=10**9, bytes_per_token=10**9)
    peaks = _peaks()
    assert [roof_of(m.key) for m in measures(PeersConfig())] == [
        "bandwidth",  # a: TPOT
        None,  # a: TTFT
        "int8 peak",  # b: output tok/s
        None,  # b: TTFT
        "int8 peak",  # c: output tok/s
        "int8 peak",  # c: total tok/s
        "int8 peak",  # d: prefill 128
        "int8 peak",  # d: prefill 1024
    ]
    # TPOT 40 ms = 25 tok/s: 25 GB/s of 50.
    assert roof_percent("a_tpot_ms", 40.0, weights, peaks) == pytest.approx(50.0)
    # 2 x 1e9 params x 128 tok/s = 256 GOPS of 256 ops/cycle x 2.5 GHz x 2 cores = 1280 GOPS.
    assert roof_percent("c_total_tok_s", 128.0, weights, peaks) == pytest.approx(20.0)
    assert math.isnan(roof_percent("a_ttft_ms", 40.0, weights, peaks))
    assert math.isnan(roof_percent("a_tpot_ms", 0.0, weights, peaks))


# ---- the table -------------------------------------------------------------------------------


def test_a_file_table_has_the_ratio_the_roof_and_each_engines_share() -> None:
    ref = ShapeRef(SHAPES["llama-3.2-1b"], "Q4_K_M")
    engines = file_engines(ref, FILE, True, ["auto"])
    values = {
        "llamacpp-q4_k_m": {"a_tpot_ms": 40.0, "a_ttft_ms": 100.0, "b_output_tok_s": 256.0},
        "llmserve-auto": {"a_tpot_ms": 50.0, "a_ttft_ms": 80.0, "b_output_tok_s": 512.0},
    }
    weights = FileWeights(num_params=10**9, bytes_per_token=10**9)
    lines = shape_table(measures(PeersConfig(), ["a", "b"]), engines, values, weights, _peaks())
    header = _cells(lines.splitlines()[0])
    assert header == [
        "measure",
        "better",
        "llama.cpp Q4_K_M",
        "llmserve auto",
        "llmserve / llama.cpp (x, > 1 = llmserve better)",
        "roof",
        "llama.cpp Q4_K_M: % of roof",
        "llmserve auto: % of roof",
    ]
    assert header[4] == RATIO_HEADER
    rows = {cells[0]: cells[1:] for cells in map(_cells, lines.splitlines()[2:])}
    assert len(rows) == 4
    # Latency: llama.cpp / llmserve; 25 and 20 tok/s of 50 GB/s at 1 GB per token.
    tpot = rows["a. 1 user 128/128: TPOT p50 ms"]
    assert tpot == ["lower", "40.0", "50.0", "0.80", "bandwidth", "50.0", "40.0"]
    ttft = rows["a. 1 user 128/128: TTFT p50 ms"]
    assert ttft == ["lower", "100.0", "80.0", "1.25", "-", "-", "-"]
    # Throughput: llmserve / llama.cpp; 2 x 1e9 x 256 = 512 GOPS of 1280 GOPS.
    throughput = rows["b. 16 users x 2 128/128: output tok/s"]
    assert throughput == ["higher", "256.0", "512.0", "2.00", "int8 peak", "40.0", "80.0"]
    b_ttft = rows["b. 16 users x 2 128/128: TTFT p50 ms"]
    assert b_ttft[1:4] == ["-", "-", "-"]  # nothing measured


def test_the_best_llmserve_column_is_compared_and_one_side_alone_has_no_ratio() -> None:
    ref = ShapeRef(SHAPES["llama-3.2-1b"], "Q4_0")
    weights = FileWeights(num_params=10**9, bytes_per_token=10**9)
    engines = file_engines(ref, FILE, True, ["auto", "none"])
    values = {
        "llamacpp-q4_0": {"c_output_tok_s": 100.0},
        "llmserve-auto": {"c_output_tok_s": 80.0},
        "llmserve-none": {"c_output_tok_s": 150.0},
    }
    table = shape_table(measures(PeersConfig(), ["c"]), engines, values, weights, _peaks())
    output = _cells(table.splitlines()[2])
    assert output[:6] == [
        "c. offline 32 x 128/128: output tok/s",
        "higher",
        "100.0",
        "80.0",
        "150.0",
        "1.50",  # llmserve none, the better of the two, against llama.cpp
    ]
    alone = file_engines(ref, FILE, False, ["auto"])
    table = shape_table(measures(PeersConfig(), ["d"]), alone, {}, weights, _peaks())
    header = _cells(table.splitlines()[0])
    assert header == ["measure", "better", "llmserve auto", "roof", "llmserve auto: % of roof"]
