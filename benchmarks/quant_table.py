"""Every KV cache and weight format on one model: memory, speed and accuracy in one markdown
table. Speed is measured in rounds that visit the formats in turn (A/B interleaved in one
process), and each speed cell is the best of the rounds (within a run, the median step),
because the CPU is shared and interference only ever adds time.

llmserve bench quant                       # the embedded model, all formats, 2 rounds
llmserve bench quant --formats fp32,bf16,int4 --rounds 3
llmserve bench quant --formats "gguf fp32" --gguf-files Q4_0,Q4_K_M,Q6_K   # GGUF formats

--gguf-files adds one row per GGUF format: the embedded Q4_1 file requantized by llama.cpp's
llama-quantize (built once, as `bench peers` does), served as its blocks. The reference of
every row is the embedded file dequantized to float32, so a requant's KL and top-1 measure
what it loses against the Q4_1 weights it was made from.
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import dataclass, field
from time import perf_counter

import torch
from torch import nn

from benchmarks.common import MiB, format_table, machine_header, median, random_prompts
from benchmarks.quant_accuracy import (
    Accuracy,
    Reference,
    build_reference,
    kl_and_top1,
    measure_accuracy,
)
from services.common.serving_config import DTypeName
from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.config import GiB, resolve_dtype
from services.worker.kv_cache import KVCacheSpec
from services.worker.loaded_model import LoadedModel

BLOCK_SIZE = 16
INPUT_LEN = 128
OUTPUT_LEN = 64
BATCH_1_OUTPUT_LEN = 32
LARGE_BATCH = 32
CAPACITY_SEQ_LEN = 1024
CAPACITY_BUDGET = GiB


@dataclass(frozen=True, slots=True)
class Format:
    label: str
    dtype: DTypeName
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    kv_cache_group_size: int = 8
    model: str | None = None
    """A GGUF file other than the embedded one (--gguf-files)."""

    @property
    def load_key(self) -> tuple[str, str, str | None]:
        """Formats with the same key share one loaded model."""
        return (self.dtype, self.quantization, self.model)

    def engine_config(self, kv_cache_bytes: int) -> EngineConfig:
        return EngineConfig(
            dtype=self.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_group_size=self.kv_cache_group_size,
            kv_cache_gib=kv_cache_bytes / GiB,
            block_size=BLOCK_SIZE,
            max_num_seqs=max(128, LARGE_BATCH),
            enable_prefix_caching=False,
            seed=0,
        )

    @property
    def weights(self) -> str:
        return self.dtype if self.quantization == "none" else self.quantization

    def kv_cache_label(self, spec: KVCacheSpec) -> str:
        """The cache the format ran: its element type (`auto` resolved), int8 with its group."""
        if self.kv_cache_dtype == "int8":
            return f"int8, group {self.kv_cache_group_size}"
        return str(spec.dtype).removeprefix("torch.")


FORMATS = (
    Format("fp32", "float32"),
    Format("fp32 + int8 KV", "float32", kv_cache_dtype="int8"),
    Format("bf16", "bfloat16"),
    Format("bf16 + int8 KV", "bfloat16", kv_cache_dtype="int8"),
    Format("bf16 + int8 KV g64", "bfloat16", kv_cache_dtype="int8", kv_cache_group_size=64),
    Format("int8", "bfloat16", "int8"),
    Format("w8a8", "bfloat16", "w8a8"),
    Format("int4", "bfloat16", "int4"),
    Format("nf4", "bfloat16", "nf4"),
    Format("gguf", "bfloat16", "gguf"),
    Format("gguf + int8 KV", "bfloat16", "gguf", kv_cache_dtype="int8"),
    Format("gguf fp32", "float32", "gguf"),
    Format("gguf fp32 + fp32 KV", "float32", "gguf", kv_cache_dtype="float32"),
    Format("gguf-exact fp32", "float32", "gguf-exact"),
)


@dataclass(slots=True)
class Speed:
    batch_1_ms: list[float] = field(default_factory=list)
    batch_32_ms: list[float] = field(default_factory=list)
    output_tokens_per_s: list[float] = field(default_factory=list)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, tied tensors once, the rotary table excluded."""
    seen: set[int] = set()
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name == "rope" or tensor is None:
            continue
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            continue
        seen.add(pointer)
        total += tensor.untyped_storage().nbytes()
    return total


def kv_spec(fmt: Format, loaded: LoadedModel) -> KVCacheSpec:
    return KVCacheSpec.for_model(
        loaded.model.architecture,
        BLOCK_SIZE,
        loaded.kv_cache_dtype(fmt.kv_cache_dtype),
        fmt.kv_cache_group_size,
    )


def max_sequences(spec: KVCacheSpec) -> int:
    """Sequences of CAPACITY_SEQ_LEN tokens that a CAPACITY_BUDGET cache holds at once."""
    blocks_per_seq = -(-CAPACITY_SEQ_LEN // spec.block_size)
    return spec.num_blocks_for_budget(CAPACITY_BUDGET) // blocks_per_seq


def run_batch(
    loaded: LoadedModel, fmt: Format, batch_size: int, output_len: int, seed: int
) -> tuple[float, float]:
    """(median ms of the steps where the whole batch decodes, output tokens/s over the run)."""
    spec = kv_spec(fmt, loaded)
    blocks = batch_size * -(-(INPUT_LEN + output_len) // BLOCK_SIZE) + 8
    engine = LLMEngine(fmt.engine_config(blocks * spec.bytes_per_block), loaded=loaded)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    for prompt in random_prompts(batch_size, INPUT_LEN, seed=seed):
        engine.add_request(prompt, sampling)
    started: set[str] = set()
    finished = 0
    decode_ms: list[float] = []
    start = perf_counter()
    while engine.has_unfinished_requests():
        all_decoding = len(started) == batch_size and finished == 0
        step_start = perf_counter()
        events = engine.step()
        if all_decoding:
            decode_ms.append(1e3 * (perf_counter() - step_start))
        for event in events:
            if event.new_token_ids:
                started.add(event.request_id)
            finished += event.finished
    total_s = perf_counter() - start
    return median(decode_ms), batch_size * output_len / total_s


Models = dict[tuple[str, str, str | None], LoadedModel]


def load_all(formats: list[Format]) -> Models:
    """One model per (dtype, weight format, file); KV-only formats share theirs."""
    models: Models = {}
    for fmt in formats:
        if fmt.load_key not in models:
            print(f"loading {fmt.label}", file=sys.stderr)
            dtype = resolve_dtype(fmt.dtype, "cpu")
            models[fmt.load_key] = LoadedModel.load(fmt.model, dtype, "cpu", fmt.quantization)
    return models


def gguf_file_formats(labels: list[str]) -> list[Format]:
    """A `gguf` float32 row per llama-quantize type of the embedded file (made once)."""
    from benchmarks.llamacpp_build import ensure_requant, ensure_tools
    from services.common.model_source import embedded_model_path

    binaries = ensure_tools(["llama-quantize"])
    source = embedded_model_path()
    return [
        Format(
            f"gguf {label}", "float32", "gguf", model=str(ensure_requant(binaries, source, label))
        )
        for label in labels
    ]


def measure_speed(formats: list[Format], models: Models, rounds: int) -> dict[str, Speed]:
    speeds = {fmt.label: Speed() for fmt in formats}
    for fmt in formats:  # untimed: allocator growth, kernel selection, packed-weight caches
        run_batch(models[fmt.load_key], fmt, 2, 4, seed=99)
    for round_index in range(rounds):
        for fmt in formats:
            print(f"round {round_index + 1}/{rounds}: {fmt.label}", file=sys.stderr)
            loaded = models[fmt.load_key]
            speed = speeds[fmt.label]
            ms_1, _ = run_batch(loaded, fmt, 1, BATCH_1_OUTPUT_LEN, seed=round_index)
            ms_32, tokens_per_s = run_batch(loaded, fmt, LARGE_BATCH, OUTPUT_LEN, round_index)
            speed.batch_1_ms.append(ms_1)
            speed.batch_32_ms.append(ms_32)
            speed.output_tokens_per_s.append(tokens_per_s)
            gc.collect()
    return speeds


def measure_accuracies(
    formats: list[Format], models: Models
) -> tuple[Reference, dict[str, Accuracy]]:
    """Against fp32 weights with an fp32 KV cache (loaded here if no format uses it)."""
    reference_fmt = Format("fp32", "float32")
    float_model = models.get(reference_fmt.load_key) or LoadedModel.load(None, torch.float32)
    print("accuracy: reference (fp32)", file=sys.stderr)
    reference: Reference = build_reference(float_model, reference_fmt.engine_config(64 * MiB))
    results = {}
    for fmt in formats:
        print(f"accuracy: {fmt.label}", file=sys.stderr)
        loaded = models[fmt.load_key]
        results[fmt.label] = measure_accuracy(loaded, fmt.engine_config(64 * MiB), reference)
    return reference, results


HEADERS = [
    "format",
    "weights",
    "KV cache",
    "weight MiB",
    "KV B/token",
    "1k-token seqs in 1 GiB",
    "decode ms/step B=1",
    "decode ms/step B=32",
    "output tok/s @32",
    "KL (nats)",
    "top-1 agree",
    "greedy-64 agree",
    "perplexity",
    "KV vs the auto KV: KL / top-1",
]


def float_kv_twin(fmt: Format) -> Format:
    """The same weights with the KV cache as `auto` resolves it."""
    return Format(f"{fmt.label} (float KV)", fmt.dtype, fmt.quantization)


def kv_effect(
    fmt: Format,
    accuracy: Accuracy,
    models: Models,
    accuracies: dict[str, Accuracy],
    reference: Reference,
) -> str:
    """KL and top-1 of a format with a named KV cache (int8, float32, ...) against its own
    weights with the cache `auto` gives them: the KV cache's own effect, apart from the
    weights'."""
    if fmt.kv_cache_dtype == "auto":
        return "-"
    twin = next(
        (
            accuracies[f.label]
            for f in FORMATS
            if f.label in accuracies
            and (f.dtype, f.quantization, f.kv_cache_dtype) == (fmt.dtype, fmt.quantization, "auto")
        ),
        None,
    )
    if twin is None:
        twin_fmt = float_kv_twin(fmt)
        loaded = models[fmt.load_key]
        twin = measure_accuracy(loaded, twin_fmt.engine_config(64 * MiB), reference)
    kl, top1 = kl_and_top1(twin.prompt_log_probs, accuracy.prompt_log_probs)
    return f"{kl:.4f} / {100 * top1:.1f} %"


def run(args: argparse.Namespace) -> int:
    by_label = {fmt.label: fmt for fmt in FORMATS}
    labels = [part.strip() for part in args.formats.split(",")] if args.formats else list(by_label)
    unknown = [label for label in labels if label not in by_label]
    if unknown or args.rounds < 1:
        print(
            f"bench quant: --formats takes some of {', '.join(by_label)} and --rounds >= 1;"
            f" got {unknown or args.rounds}",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [by_label[label] for label in labels]
    gguf_labels = [part.strip() for part in args.gguf_files.split(",") if part.strip()]
    if gguf_labels:
        formats += gguf_file_formats(gguf_labels)
    models = load_all(formats)
    speeds = measure_speed(formats, models, args.rounds)
    reference, accuracies = (
        (None, {}) if args.skip_accuracy else measure_accuracies(formats, models)
    )
    rows: list[list[object]] = []
    for fmt in formats:
        loaded = models[fmt.load_key]
        spec = kv_spec(fmt, loaded)
        speed = speeds[fmt.label]
        accuracy = accuracies.get(fmt.label)
        nan = float("nan")
        if accuracy is None or reference is None:
            accuracy_cells: list[object] = [nan, nan, nan, nan, "-"]
        else:
            accuracy_cells = [
                f"{accuracy.kl_divergence:.4f}",
                f"{100 * accuracy.top1_agreement:.1f} %",
                f"{100 * accuracy.greedy_agreement:.0f} %",
                accuracy.perplexity,
                kv_effect(fmt, accuracy, models, accuracies, reference),
            ]
        rows.append(
            [
                fmt.label,
                fmt.weights,
                fmt.kv_cache_label(spec),
                weight_bytes(loaded.model) / MiB,
                spec.bytes_per_token,
                max_sequences(spec),
                min(speed.batch_1_ms),
                min(speed.batch_32_ms),
                max(speed.output_tokens_per_s),
                *accuracy_cells,
            ]
        )
    print(machine_header(torch.get_num_threads()))
    print(
        f"\nEmbedded SmolLM2-135M-Instruct; speed: {INPUT_LEN}-token random prompts, "
        f"{BATCH_1_OUTPUT_LEN} (B=1) / {OUTPUT_LEN} (B={LARGE_BATCH}) greedy tokens, median "
        f"step, best of {args.rounds} interleaved rounds; accuracy vs fp32 weights + fp32 KV, "
        "teacher-forced through the KV cache.\n"
    )
    print(format_table(HEADERS, rows))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "quant", help="KV cache and weight formats: memory, speed, accuracy (markdown table)"
    )
    parser.add_argument(
        "--formats",
        default="",
        help=f"comma-separated subset of: {', '.join(f.label for f in FORMATS)}",
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    parser.add_argument(
        "--gguf-files",
        default="",
        help="llama-quantize types of the embedded file to add as rows, e.g. Q4_0,Q4_K_M,Q6_K",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--skip-accuracy", action="store_true", help="memory and speed only")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__)
    add_parser(cli.add_subparsers(dest="command", required=True))
    parsed = cli.parse_args(["quant", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
