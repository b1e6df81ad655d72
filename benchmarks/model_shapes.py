"""Real-size models with random weights, for measuring memory and speed at the sizes users run
(1B to 8B) on a machine that cannot download weights. Each shape is a published model's
architecture (hidden size, layers, heads, MLP, attention layout) with the embedded model's
vocabulary (SmolLM2, 49152 tokens) instead of its own, so the files serve end to end.

    python -m benchmarks.model_shapes list
    python -m benchmarks.model_shapes build llama-3.2-1b --types Q4_K_M,Q4_0
    python -m benchmarks.model_shapes build llama-3.1-8b          # written directly, Q4_K_M

How a file is made (HF shapes): transformers builds the model with random init in bf16, it is
saved as a Hugging Face directory with the embedded tokenizer, llama.cpp's
convert_hf_to_gguf.py turns it into a BF16 GGUF, and llama-quantize makes each requested type;
the directory and the BF16 file are deleted. Shapes too large to build that way in memory
(llama-3.1-8b) are written directly as Q4_K_M by benchmarks/synthetic_gguf.py.

    ${LLMSERVE_CACHE_DIR:-~/.cache/llmserve}/shapes/
      llama-3.2-1b/llama-3.2-1b.Q4_K_M.gguf        the file
      llama-3.2-1b/llama-3.2-1b.Q4_K_M.gguf.json   how it was made: params, seconds per stage
      llama-3.2-1b.lock                            held while building (fcntl)

A file only ever appears whole: it is written under a temporary name and renamed
(services/common/cache_files.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.llamacpp_build import converter_env
from services.common import cache_files

EMBEDDED_VOCAB_SIZE = 49152
"""SmolLM2-135M-Instruct's vocabulary: the tokenizer every shape carries."""
QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q6_K", "Q5_K_M", "BF16")
"""What `build --types` accepts: llama-quantize's names (BF16: the converter's file kept)."""
DIRECT_TYPE = "Q4_K_M"
CONVERT_TIMEOUT_S = 3600
QUANTIZE_TIMEOUT_S = 3600
LOG_TAIL_LINES = 30


class ShapeBuildError(RuntimeError):
    """A shape could not be built; the message says which stage and where its log is."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """One published architecture, in the numbers that decide weights and KV bytes."""

    name: str
    config_class: str
    """The transformers config class (its model_type picks the converter's model class)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim_override: int | None = None
    """Set where head_dim != hidden_size / num_heads (Gemma 3)."""
    tied_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    """A norm over head_dim on q and k (Gemma 3)."""
    norms_per_layer: int = 2
    """RMSNorms of hidden_size per layer: 2 (pre-attention, pre-MLP), 4 with post-norms."""
    config: dict[str, Any] = field(default_factory=dict)
    """The rest of the transformers config: rope, context length, windows, eps."""
    direct: bool = False
    """Written with gguf-py as Q4_K_M (synthetic_gguf.py), not through transformers."""
    vocab_size: int = EMBEDDED_VOCAB_SIZE

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Every weight: embeddings, each layer's attention, MLP and norms, the final norm, and
        the output matrix when it is not tied to the embeddings."""
        hidden, head_dim = self.hidden_size, self.head_dim
        q_size = self.num_heads * head_dim
        kv_size = self.num_kv_heads * head_dim
        attention = hidden * (q_size + 2 * kv_size) + q_size * hidden
        if self.qkv_bias:
            attention += q_size + 2 * kv_size
        if self.qk_norm:
            attention += 2 * head_dim
        mlp = 3 * hidden * self.intermediate_size  # gate, up, down
        layer = attention + mlp + self.norms_per_layer * hidden
        embeddings = self.vocab_size * hidden
        output = 0 if self.tied_embeddings else self.vocab_size * hidden
        return embeddings + self.num_layers * layer + hidden + output

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """K and V of every layer for one token (f16: 2 bytes per value)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    @property
    def types(self) -> tuple[str, ...]:
        """The types `build` makes when none are asked for."""
        return (DIRECT_TYPE,) if self.direct else ("Q4_K_M",)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA3_CONFIG = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": LLAMA3_ROPE,
}

SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3.2-1b", "LlamaConfig", 2048, 16, 32, 8, 8192, config=LLAMA3_CONFIG),
        ModelShape("llama-3.2-3b", "LlamaConfig", 3072, 28, 24, 8, 8192, config=LLAMA3_CONFIG),
        ModelShape(
            "qwen2.5-1.5b",
            "Qwen2Config",
            1536,
            28,
            12,
            2,
            8960,
            qkv_bias=True,
            config={
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "use_sliding_window": False,
            },
        ),
        ModelShape(
            "gemma-3-1b",
            "Gemma3TextConfig",
            1152,
            26,
            4,
            1,
            6912,
            head_dim_override=256,
            qk_norm=True,
            norms_per_layer=4,
            config={
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 256,
                "sliding_window": 512,
                # Every 6th layer attends globally, the other five within the window.
                "layer_types": [
                    "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
                ],
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            },
        ),
        ModelShape(
            "llama-3.1-8b",
            "LlamaConfig",
            4096,
            32,
            32,
            8,
            14336,
            tied_embeddings=False,
            config={**LLAMA3_CONFIG, "rope_parameters": {**LLAMA3_ROPE, "factor": 8.0}},
            direct=True,
        ),
    )
}


# ---- names and places --------------------------------------------------------------------


def shapes_dir() -> Path:
    return cache_files.cache_root() / "shapes"


def shape_file(shape: ModelShape, quant_type: str, root: Path | None = None) -> Path:
    return (root or shapes_dir()) / shape.name / f"{shape.name}.{quant_type}.gguf"


def parse_shape_ref(text: str) -> tuple[ModelShape, str]:
    """'llama-3.2-1b:Q4_K_M' -> (the shape, 'Q4_K_M'); without a type, the shape's default."""
    name, _, quant_type = text.partition(":")
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    return shape, check_types(shape, [quant_type or shape.types[0]])[0]


def check_types(shape: ModelShape, types: Sequence[str]) -> list[str]:
    """The requested types, upper-cased and checked against what this shape can be built as."""
    wanted = list(dict.fromkeys(t.strip().upper() for t in types if t.strip()))
    allowed = (DIRECT_TYPE,) if shape.direct else QUANT_TYPES
    bad = [t for t in wanted if t not in allowed]
    if bad or not wanted:
        raise ValueError(
            f"{shape.name}: types must be some of {', '.join(allowed)}; got {', '.join(bad)}"
        )
    return wanted


def built_file(text: str, root: Path | None = None) -> Path:
    """The cached file of a 'shape:TYPE' reference; an error naming the build command when it
    has not been built."""
    shape, quant_type = parse_shape_ref(text)
    path = shape_file(shape, quant_type, root)
    if not path.is_file():
        raise FileNotFoundError(
            f"{text} is not built: python -m benchmarks.model_shapes build {shape.name}"
            f" --types {quant_type}"
        )
    return path


def write_record(path: Path, record: dict[str, Any]) -> None:
    cache_files.write_text(path.with_name(path.name + ".json"), json.dumps(record, indent=1) + "\n")


def read_record(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.with_name(path.name + ".json").read_text()))
    except (OSError, ValueError):
        return {}


# ---- the HF route: transformers -> convert_hf_to_gguf.py -> llama-quantize ---------------


def save_embedded_tokenizer(directory: Path) -> dict[str, int]:
    """The embedded model's tokenizer as a Hugging Face tokenizer (tokenizer.json, its config
    and chat template); returns the bos/eos/pad ids for the model config. Its pre-tokenizer
    hashes to the converter's 'smollm' entry, so the converter accepts it as it is."""
    from transformers import PreTrainedTokenizerFast

    from services.common.model_source import embedded_model_path
    from services.text.model_tokenizer import ModelTokenizer

    embedded = ModelTokenizer.from_path(embedded_model_path())
    specials = {
        key: value
        for key, value in embedded.special_tokens.items()
        if key in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=embedded.tokenizer, clean_up_tokenization_spaces=False, **specials
    )
    if embedded.chat_template is not None:
        tokenizer.chat_template = embedded.chat_template.source
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # Not the family's class: transformers 5 would rebuild a Llama tokenizer's pre-tokenizer.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["add_bos_token"] = embedded.add_bos_token
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    eos = embedded.eos_token_ids[0]
    pad = embedded.tokenizer.token_to_id(specials.get("pad_token", "")) or eos
    return {"bos_token_id": embedded.bos_token_id or eos, "eos_token_id": eos, "pad_token_id": pad}


def save_random_hf_model(shape: ModelShape, directory: Path, seed: int = 0) -> None:
    """transformers' own model class with its own random init (std 0.02), in bf16."""
    import torch
    import transformers

    token_ids = save_embedded_tokenizer(directory)
    config_class = getattr(transformers, shape.config_class)
    config = config_class(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        tie_word_embeddings=shape.tied_embeddings,
        **({"head_dim": shape.head_dim_override} if shape.head_dim_override else {}),
        **token_ids,
        **json.loads(json.dumps(shape.config)),  # a copy: config classes edit dicts in place
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(directory), max_shard_size="1GB")
    del model


QUANTIZE_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
CONVERTER_WRITING = re.compile(rb"Writing:\s+(\d+)%")


def run_with_progress(
    command: Sequence[str],
    log_path: Path,
    description: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> None:
    """Run a tool, its output to `log_path`, its own progress (llama-quantize's '[i/n]', the
    converter's 'Writing: N%') on one terminal line; on failure the error shows the log's
    tail."""
    started = time.monotonic()
    last_shown = ""
    with log_path.open("ab") as log:
        log.write(f"\n$ {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        assert process.stdout is not None
        output = process.stdout.fileno()
        try:
            for chunk in iter(lambda: os.read(output, 65536), b""):
                log.write(chunk)
                shown = progress_of(chunk)
                if shown and shown != last_shown:
                    elapsed = time.monotonic() - started
                    print(f"\r  {description}: {shown} ({elapsed:.0f} s)", end="", flush=True)
                    last_shown = shown
                if time.monotonic() - started > timeout_s:
                    raise ShapeBuildError(f"{description} took over {timeout_s:.0f} s")
            code = process.wait()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    print(f"\r  {description}: done ({time.monotonic() - started:.0f} s)" + " " * 20, flush=True)
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        raise ShapeBuildError(f"{description} failed (exit {code}); log {log_path}:\n{tail}")


def progress_of(chunk: bytes) -> str:
    """The newest progress mark in a chunk of tool output ('' when it holds none)."""
    shown = ""
    for match in CONVERTER_WRITING.finditer(chunk):
        shown = f"writing {int(match.group(1))}%"
    for line in chunk.decode(errors="replace").splitlines():
        found = QUANTIZE_PROGRESS.match(line.strip())
        if found:
            shown = f"tensor {found.group(1)}/{found.group(2)}"
    return shown


# The converter hashes what AutoTokenizer encodes to name the pre-tokenizer. transformers 5
# forces some families' own tokenizer class whatever tokenizer_config.json says (Qwen2's
# rebuilds its pre-tokenizer, whose hash the converter does not know), so the converter runs
# with every family mapped to the class that keeps tokenizer.json as saved.
CONVERTER_PRELUDE = """
import os, runpy, sys
from transformers.models.auto import tokenization_auto as auto
for name in list(auto.TOKENIZER_MAPPING_NAMES):
    auto.TOKENIZER_MAPPING_NAMES[name] = "TokenizersBackend"
auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.clear()
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def convert_command(source: Path, hf_dir: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-c",
        CONVERTER_PRELUDE,
        str(source / "convert_hf_to_gguf.py"),
        str(hf_dir),
        "--outfile",
        str(out),
        "--outtype",
        "bf16",
    ]


def quantize_command(quantize: Path, source: Path, out: Path, quant_type: str) -> list[str]:
    return [str(quantize), str(source), str(out), quant_type]


def build_hf_shape(shape: ModelShape, types: Sequence[str], root: Path) -> dict[str, Path]:
    """Build the missing `types` of an HF-route shape (one HF directory and BF16 file for all
    of them); returns every requested type's path."""
    from benchmarks.llamacpp_build import ensure_source, ensure_tools

    directory = root / shape.name
    paths = {t: shape_file(shape, t, root) for t in types}
    missing = [t for t, path in paths.items() if not path.is_file()]
    if not missing:
        return paths
    quantize = None
    if [t for t in missing if t != "BF16"]:
        quantize = ensure_tools(["llama-quantize"]).quantize
    source = ensure_source()
    log_path = directory / "build.log"
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="build-", dir=directory) as scratch:
        hf_dir = Path(scratch) / "hf"
        hf_dir.mkdir()
        print(f"  random {shape.config_class} in bf16 -> {hf_dir}", flush=True)
        started = time.monotonic()
        save_random_hf_model(shape, hf_dir)
        times["hf_s"] = time.monotonic() - started
        print(f"  saved the HF directory ({times['hf_s']:.0f} s)", flush=True)
        bf16 = Path(scratch) / f"{shape.name}.BF16.gguf"
        started = time.monotonic()
        run_with_progress(
            convert_command(source, hf_dir, bf16),
            log_path,
            "convert_hf_to_gguf.py -> BF16",
            CONVERT_TIMEOUT_S,
            env=converter_env(source),
        )
        times["convert_s"] = time.monotonic() - started
        shutil.rmtree(hf_dir)  # the BF16 file is all the quantizer needs
        for quant_type in missing:
            started = time.monotonic()
            out = paths[quant_type]
            with cache_files.staged(out) as partial:
                if quant_type == "BF16":
                    shutil.copyfile(bf16, partial)
                else:
                    assert quantize is not None
                    run_with_progress(
                        quantize_command(quantize, bf16, partial, quant_type),
                        log_path,
                        f"llama-quantize {quant_type}",
                        QUANTIZE_TIMEOUT_S,
                    )
            stage_s = time.monotonic() - started
            write_record(out, record(shape, quant_type, {**times, "quantize_s": stage_s}))
    return paths


def record(shape: ModelShape, quant_type: str, times: dict[str, float]) -> dict[str, Any]:
    from benchmarks.llamacpp_build import build_info

    return {
        "shape": shape.name,
        "type": quant_type,
        "num_params": shape.num_params,
        "vocab_size": shape.vocab_size,
        "seconds": {k: round(v, 1) for k, v in times.items()},
        "build_s": round(sum(times.values()), 1),
        "llama_cpp_commit": build_info().get("llama_cpp_commit"),
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def build(shape: ModelShape, types: Sequence[str], root: Path | None = None) -> dict[str, Path]:
    """Every requested type of `shape`, built once into the cache and reused after."""
    root = root or shapes_dir()
    wanted = check_types(shape, types)
    # One builder per shape at a time; another process waits, then finds the files made.
    waiting = f"waiting for another build of {shape.name}"
    with cache_files.locked(root / shape.name, lambda: print(waiting, file=sys.stderr, flush=True)):
        (root / shape.name).mkdir(parents=True, exist_ok=True)
        if shape.direct:
            from benchmarks.synthetic_gguf import write_q4_k_m

            out = shape_file(shape, DIRECT_TYPE, root)
            if not out.is_file():
                started = time.monotonic()
                with cache_files.staged(out) as partial:
                    write_q4_k_m(shape, partial)
                seconds = {"write_s": time.monotonic() - started}
                write_record(out, record(shape, DIRECT_TYPE, seconds))
            return {DIRECT_TYPE: out}
        return build_hf_shape(shape, wanted, root)


# ---- the command -------------------------------------------------------------------------


def describe(shape: ModelShape) -> str:
    return (
        f"{shape.name}: {shape.num_params / 1e9:.3f}B params (vocab {shape.vocab_size}), "
        f"hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads} heads, "
        f"{shape.num_kv_heads} KV heads x {shape.head_dim}, MLP {shape.intermediate_size}, "
        f"{'tied' if shape.tied_embeddings else 'untied'}; "
        f"KV {shape.kv_bytes_per_token() / 1024:.0f} KiB/token in f16"
    )


def list_command(root: Path) -> int:
    for shape in SHAPES.values():
        print(describe(shape))
        for path in sorted((root / shape.name).glob(f"{shape.name}.*.gguf")):
            built = read_record(path)
            seconds = f", built in {built['build_s']:.0f} s" if "build_s" in built else ""
            print(f"  {path}  {path.stat().st_size / (1 << 20):.0f} MiB{seconds}")
    return 0


def build_command(names: Sequence[str], types_text: str | None, root: Path) -> int:
    from benchmarks.llamacpp_build import PeerBuildError

    for name in names:
        if name not in SHAPES:
            print(f"model_shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
            return 2
        shape = SHAPES[name]
        try:
            types = check_types(shape, types_text.split(",")) if types_text else shape.types
        except ValueError as exc:
            print(f"model_shapes: {exc}", file=sys.stderr)
            return 2
        print(describe(shape), flush=True)
        started = time.monotonic()
        try:
            paths = build(shape, types, root)
        except (ShapeBuildError, PeerBuildError, OSError) as exc:
            print(f"model_shapes: {name}: {exc}", file=sys.stderr)
            return 1
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
        for path in paths.values():
            print(f"{path}\t{path.stat().st_size / (1 << 20):.0f} MiB", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=None, help="cache directory (default: see above)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the shapes, their sizes and the files built")
    build_parser = sub.add_parser("build", help="build shapes into the cache (once)")
    build_parser.add_argument("names", nargs="+", help=", ".join(SHAPES))
    build_parser.add_argument(
        "--types", default=None, help=f"comma-separated, some of {', '.join(QUANT_TYPES)}"
    )
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else shapes_dir()
    if args.command == "list":
        return list_command(root)
    return build_command(args.names, args.types, root)


if __name__ == "__main__":
    sys.exit(main())
