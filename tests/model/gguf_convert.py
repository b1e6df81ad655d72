"""GGUF files of the tiny test models, made by llama.cpp's own tools from the sources the bench
builds from: convert_hf_to_gguf.py (f32, q8_0) run with this interpreter and the sources'
gguf-py, and llama-quantize (K-quants, Q4_0, IQ4_NL) built once into the shared cache.

    convert_to_gguf(hf_dir, out, "f32")         # -> out, or raises ConversionRefused
    quantize_gguf(f32_file, out, "Q4_K_M")      # -> QuantizeResult (path, the tool's log)
    tiny_gguf("qwen3", "Q4_K_M")                # -> the cached file, made once
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.llamacpp_build import converter_env
from services.common import cache_files
from tests.model.gguf_header import TensorInfo, read_gguf_header
from tests.model.tiny_models import tiny_model_dir

CONVERTER_OUTTYPES = ("f32", "q8_0")
QUANT_KINDS = ("Q4_K_M", "Q6_K", "Q5_K_M", "Q4_0", "IQ4_NL")
CONVERT_TIMEOUT_S = 600
QUANTIZE_TIMEOUT_S = 300
LOG_TAIL_LINES = 30


class ConversionRefused(RuntimeError):
    """convert_hf_to_gguf.py exited with an error; `reason` is its last error line."""

    def __init__(self, hf_dir: Path, reason: str, log: str) -> None:
        super().__init__(f"convert_hf_to_gguf.py refused {hf_dir}: {reason}")
        self.reason = reason
        self.log = log


@dataclass(frozen=True, slots=True)
class QuantizeResult:
    path: Path
    log: str


def llama_cpp_source() -> Path:
    """The vendored llama.cpp of the bench's llama-cpp-python sdist (fetched on first use)."""
    from benchmarks.llamacpp_build import ensure_source

    return ensure_source()


def refusal_reason(log: str) -> str:
    """The converter's own words: the last exception line, or its last error log line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]+(Error|Exception|Refused)\b.*:", line):
            return line
    errors = [line for line in lines if line.startswith("ERROR")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


def convert_to_gguf(hf_dir: Path, out_path: Path, outtype: str) -> Path:
    """`hf_dir` as a GGUF file at `out_path` (`outtype` f32 or q8_0, written by the converter
    itself). Raises ConversionRefused with the converter's reason when it declines."""
    if outtype not in CONVERTER_OUTTYPES:
        raise ValueError(f"outtype: one of {CONVERTER_OUTTYPES}, got {outtype!r}")
    source = llama_cpp_source()
    with cache_files.staged(out_path) as partial:  # a file only ever appears whole
        command = [
            sys.executable,
            str(source / "convert_hf_to_gguf.py"),
            str(hf_dir),
            "--outfile",
            str(partial),
            "--outtype",
            outtype,
        ]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            errors="replace",
            env=converter_env(source),
            timeout=CONVERT_TIMEOUT_S,
            check=False,
        )
        log = result.stdout + result.stderr
        if result.returncode != 0 or not partial.is_file():
            raise ConversionRefused(hf_dir, refusal_reason(log), log)
    return out_path


def quantize_binary() -> Path:
    """llama-quantize, built alone from the same sources on first use (a few minutes on 2
    cores; then cached beside the bench's tools). Raises PeerBuildError when it cannot be."""
    from benchmarks.llamacpp_build import ensure_tools

    return ensure_tools(["llama-quantize"]).quantize


def quantize_gguf(src: Path, dst: Path, kind: str) -> QuantizeResult:
    """`src` (an f32 GGUF) quantized to `kind` by llama-quantize. Tensors whose rows are not a
    multiple of the kind's block keep another type: the log names them."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind: one of {QUANT_KINDS}, got {kind!r}")
    binary = quantize_binary()
    with cache_files.staged(dst) as partial:
        result = subprocess.run(
            [str(binary), str(src), str(partial), kind],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=QUANTIZE_TIMEOUT_S,
            check=False,
        )
        log = result.stdout + result.stderr
        if result.returncode != 0 or not partial.is_file():
            tail = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
            raise RuntimeError(f"llama-quantize {kind} failed (exit {result.returncode}):\n{tail}")
    return QuantizeResult(dst, log)


def read_tensors(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> type and shape, from the header."""
    return read_gguf_header(path).tensors


def read_metadata(path: Path, *keys: str) -> dict[str, object]:
    metadata = read_gguf_header(path).metadata
    return {key: metadata[key] for key in keys if key in metadata}


def type_counts(path: Path) -> Counter[str]:
    return Counter(info.type_name for info in read_tensors(path).values())


def tiny_gguf(family: str, kind: str, cache_root: Path | None = None) -> Path:
    """The family's tiny model as GGUF `kind` ("f32", "q8_0" from the converter; a QUANT_KINDS
    entry from llama-quantize applied to the f32 file), made once beside its HF directory."""
    hf_dir = tiny_model_dir(family, cache_root)
    out = hf_dir.parent / "gguf" / f"{family}.{kind}.gguf"
    if out.is_file():
        return out
    if kind in CONVERTER_OUTTYPES:
        return cache_files.make_once(out, lambda partial: convert_to_gguf(hf_dir, partial, kind))
    f32 = tiny_gguf(family, "f32", cache_root)
    return cache_files.make_once(out, lambda partial: quantize_gguf(f32, partial, kind))


def timed_quantize_binary() -> tuple[Path, float | None]:
    """quantize_binary(), and how long building it took (None when it was already built)."""
    from benchmarks.llamacpp_build import cache_dir

    already_built = os.access(cache_dir() / "bin" / "llama-quantize", os.X_OK)
    start = time.monotonic()
    binary = quantize_binary()
    return binary, None if already_built else time.monotonic() - start
