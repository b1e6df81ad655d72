"""`llmserve bench peers --shapes`, the pure part: the list of real-size files (SPEC), what a
file's weights cost per token, how near a measured speed comes to the machine's roofs, and the
table of one file with llama.cpp and llmserve on it. Values in, markdown out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import MiB, format_table
from benchmarks.compare import EngineSpec, engine_specs
from benchmarks.machine_peaks import MachinePeaks
from benchmarks.model_shapes import DIRECT_TYPE, QUANT_TYPES, SHAPES, ModelShape
from benchmarks.peers_table import Measure, advantage, best_llmserve
from services.common.gguf_index import GGUFTensor

DEFAULT_TYPE = "Q4_K_M"
"""The type of a SPEC item without one: the type most published GGUF files come in."""
BANDWIDTH = "bandwidth"
INT8_PEAK = "int8 peak"
RATIO_HEADER = "llmserve / llama.cpp (x, > 1 = llmserve better)"


# ---- the files -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShapeRef:
    """One item of --shapes: a shape of benchmarks/model_shapes.py as one GGUF type."""

    shape: ModelShape
    quant_type: str

    @property
    def label(self) -> str:
        return f"{self.shape.name}:{self.quant_type}"

    @property
    def slug(self) -> str:
        """Its output directory's name."""
        return f"{self.shape.name}.{self.quant_type}"


def parse_shapes_spec(text: str) -> list[ShapeRef]:
    """'llama-3.2-1b:Q4_K_M,llama-3.2-3b' -> one ShapeRef each (Q4_K_M when no type is
    given), repeats dropped; an unknown shape or type raises an error naming the item."""
    refs: list[ShapeRef] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, quant_type = item.partition(":")
        shape = SHAPES.get(name.strip())
        if shape is None:
            raise ValueError(
                f"--shapes: unknown shape {name.strip()!r} in {item!r}; known: {', '.join(SHAPES)}"
            )
        quant_type = quant_type.strip().upper() or DEFAULT_TYPE
        allowed = (DIRECT_TYPE,) if shape.direct else QUANT_TYPES
        if quant_type not in allowed:
            raise ValueError(
                f"--shapes: unknown type {quant_type!r} in {item!r}; {shape.name} is built as"
                f" {', '.join(allowed)}"
            )
        ref = ShapeRef(shape, quant_type)
        if ref not in refs:
            refs.append(ref)
    if not refs:
        raise ValueError(f"--shapes: no file named; e.g. {next(iter(SHAPES))}:{DEFAULT_TYPE}")
    return refs


def file_engines(
    ref: ShapeRef,
    path: Path,
    with_llamacpp: bool,
    llmserve_quantizations: Sequence[str],
    stack_quantizations: Sequence[str] = (),
    llmserve_drafting: Sequence[bool] = (True,),
) -> list[EngineSpec]:
    """The columns of one file's table, every one loading that file: llama.cpp first, then
    llmserve per quantization (and per drafting setting), then the stack's."""
    return engine_specs(
        [ref.quant_type] if with_llamacpp else [],
        llmserve_quantizations,
        stack_quantizations,
        {ref.quant_type: path},
        path,
        [ref.quant_type],
        llmserve_drafting,
    )


@dataclass(frozen=True, slots=True)
class FileWeights:
    """The weights one generated token goes through: each matrix is read whole, and its
    parameters are one multiply-add each."""

    num_params: int
    bytes_per_token: int


def file_weights(tensors: Iterable[GGUFTensor]) -> FileWeights:
    """Every tensor of the file, but the token embeddings when the file has an output matrix
    of its own: then a token reads one row of them (a lookup), not the table. Tied files use
    the embeddings as the output matrix, which every token reads whole."""
    tensors = list(tensors)
    untied = any(tensor.name == "output.weight" for tensor in tensors)
    read = [t for t in tensors if not (untied and t.name == "token_embd.weight")]
    return FileWeights(sum(t.num_values for t in read), sum(t.num_bytes for t in read))


# ---- the roofs -------------------------------------------------------------------------------


def roof_of(key: str) -> str | None:
    """Which roof bounds a measure: one user's decode streams the weights (bandwidth); a
    batch of tokens shares each weight read, so many users, the offline batch and a prefill
    are bound by the multiply-adds (int8 peak). TTFT rows mix both with queueing: none."""
    if key == "a_tpot_ms":
        return BANDWIDTH
    if key in ("b_output_tok_s", "c_output_tok_s", "c_total_tok_s") or key.startswith("d_prefill_"):
        return INT8_PEAK
    return None


def tokens_per_s(key: str, value: float) -> float:
    """A row's value as tokens per second (a's TPOT: 1000 / ms)."""
    if key == "a_tpot_ms":
        return 1e3 / value if value > 0 else math.nan
    return value


def bandwidth_percent(tokens_per_s: float, bytes_per_token: int, bytes_per_s: float) -> float:
    """% of the read bandwidth a decode at `tokens_per_s` uses for its weights."""
    if not (tokens_per_s > 0 and bytes_per_s > 0):  # NaN fails both comparisons
        return math.nan
    return 100 * tokens_per_s * bytes_per_token / bytes_per_s


def int8_percent(tokens_per_s: float, num_params: int, ops_per_s: float) -> float:
    """% of the int8 peak that 2 x parameters ops per token come to."""
    if not (tokens_per_s > 0 and ops_per_s > 0):
        return math.nan
    return 100 * 2 * num_params * tokens_per_s / ops_per_s


def roof_percent(key: str, value: float, weights: FileWeights, peaks: MachinePeaks) -> float:
    """How near a row's value comes to its roof, in %; NaN for rows without one."""
    speed = tokens_per_s(key, value)
    roof = roof_of(key)
    if roof == BANDWIDTH:
        return bandwidth_percent(speed, weights.bytes_per_token, peaks.read_bytes_per_s)
    if roof == INT8_PEAK:
        return int8_percent(speed, weights.num_params, peaks.int8_ops_per_s)
    return math.nan


def roof_percents(
    table_measures: Sequence[Measure],
    engines: Sequence[EngineSpec],
    values: Mapping[str, Mapping[str, float]],
    weights: FileWeights,
    peaks: MachinePeaks,
) -> dict[str, dict[str, float]]:
    """Per engine, the % of its roof of every measure that has one."""
    return {
        engine.name: {
            measure.key: roof_percent(
                measure.key, values.get(engine.name, {}).get(measure.key, math.nan), weights, peaks
            )
            for measure in table_measures
            if roof_of(measure.key) is not None
        }
        for engine in engines
    }


# ---- the table -------------------------------------------------------------------------------


SHAPES_LEGEND = (
    f"{RATIO_HEADER}: how many times better llmserve is than llama.cpp on this file "
    "(throughputs: llmserve / llama.cpp; latencies: llama.cpp / llmserve; the best llmserve "
    f"column when there are several). roof: {BANDWIDTH} = tokens/s x weight bytes read per token"
    " / the measured read bandwidth (a: tokens/s = 1000 / TPOT; KV reads left out); "
    f"{INT8_PEAK} = 2 x parameters x tokens/s / the int8 peak (an output tok/s row counts "
    "generated tokens only, and so understates a run that also prefilled its prompts). "
    "'-': not measured, failed, or no roof."
)


def file_header(ref: ShapeRef, path: Path, weights: FileWeights) -> str:
    return (
        f"## {ref.label} ({path})\n"
        f"weights: {weights.num_params / 1e9:.3f}B parameters, "
        f"{weights.bytes_per_token / MiB:.0f} MiB read per generated token (every tensor of the"
        " file, less the token embeddings where the file has an output matrix of its own)"
    )


def shape_table(
    table_measures: Sequence[Measure],
    engines: Sequence[EngineSpec],
    values: Mapping[str, Mapping[str, float]],
    weights: FileWeights,
    peaks: MachinePeaks,
) -> str:
    """Rows = measures, columns = engines on one file; then llmserve's advantage over
    llama.cpp, the row's roof and each engine's % of it. A missing value prints as '-'."""
    reference = next((engine for engine in engines if not engine.is_llmserve), None)
    compared = reference is not None and any(engine.is_llmserve for engine in engines)
    headers = ["measure", "better", *(engine.title for engine in engines)]
    headers += [RATIO_HEADER] if compared else []
    headers += ["roof", *(f"{engine.title}: % of roof" for engine in engines)]
    percents = roof_percents(table_measures, engines, values, weights, peaks)
    rows: list[list[object]] = []
    for measure in table_measures:
        measured = [values.get(e.name, {}).get(measure.key, math.nan) for e in engines]
        row: list[object] = [measure.label, "higher" if measure.higher_is_better else "lower"]
        row += measured
        if compared:
            assert reference is not None
            _, ours = best_llmserve(measure, engines, values)
            theirs = values.get(reference.name, {}).get(measure.key, math.nan)
            row.append(advantage(ours, theirs, measure.higher_is_better))
        row.append(roof_of(measure.key) or "-")
        row += [percents[e.name].get(measure.key, math.nan) for e in engines]
        rows.append(row)
    return format_table(headers, rows)
