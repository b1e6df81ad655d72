"""llmserve against llama.cpp's own C++ tools, the pure part: which engines and workloads, the
command lines of `llama-server`, `llama-bench`, `llama-batched-bench` and of our own
benchmarks and parsers for what they print (the table itself: peers_table.py).
`llmserve bench peers` (peers.py, its processes in peers_runner.py) starts them; nothing here does.

Workloads (letters as in docs/benchmarks.md):

    a  one user      128-token prompt, 128 greedy tokens, EOS ignored  -> TPOT p50, TTFT p50
    b  many users    16 users x 2 requests each, concurrency 16        -> output tok/s, TTFT p50
    c  offline       32 sequences x 128/128 in one batch               -> output (total) tok/s
    d  prefill       batch 1, 128 and 1024-token prompts               -> prompt tok/s

a and b go through the same client (`bench serve`) for both: llama-server over its OpenAI
API, llmserve in-process (or its stack over gRPC). c and d use each side's own offline tool:
llama-batched-bench / llama-bench against `bench offline`'s cell runner on the same shapes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from benchmarks.common import median
from benchmarks.serve_compare import stack_up_flags
from services.common.serving_config import RuntimeConfig, WeightsConfig

WORKLOADS = ("a", "b", "c", "d")
SERVE_WORKLOADS = ("a", "b")
EngineKind = Literal["llamacpp", "llmserve", "llmserve-stack"]
LLAMACPP_QUANTS = ("Q4_0", "Q4_1", "Q4_K_M")
"""The files compared: llama-quantize's requants of the shipped file and the file itself."""
SHIPPED_QUANT = "Q4_1"
# llama-server splits its context evenly over the slots (-np N without --kv-unified); each slot
# holds prompt + output, plus room for a BOS or a tokenizer disagreement, rounded up to
# llama.cpp's own padding of 256 cells.
SLOT_MARGIN_TOKENS = 16
CTX_PADDING = 256


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class PeersConfig:
    """The workload shapes and per-engine settings, the same for every engine."""

    input_len: int = 128
    output_len: int = 128
    single_user_prompts: int = 8
    """a: requests, one at a time."""
    num_users: int = 16
    """b: concurrency, and llama-server's parallel slots."""
    requests_per_user: int = 2
    offline_batch: int = 32
    """c: sequences in the one offline batch."""
    prefill_lens: tuple[int, ...] = (128, 1024)
    """d: prompt lengths prefilled at batch 1."""
    threads: int = 2
    """Compute threads of every engine."""
    repeats: int = 3
    """c, d: runs per shape; the median counts."""
    warmup: int | None = None
    """a, b: untimed requests first; None = 2 for one user, one per user for many."""
    seed: int = 0
    dtype: str = WeightsConfig.dtype
    """llmserve weights/activations."""
    enforce_eager: bool = RuntimeConfig.enforce_eager
    """llmserve: no compiled step graphs."""

    @property
    def multi_user_prompts(self) -> int:
        return self.num_users * self.requests_per_user

    def serve_prompts(self, workload: str) -> int:
        return self.single_user_prompts if workload == "a" else self.multi_user_prompts

    def serve_concurrency(self, workload: str) -> int:
        return 1 if workload == "a" else self.num_users

    def serve_warmup(self, workload: str) -> int:
        # A full wave of users for b, so every batch size up to it has run once untimed.
        if self.warmup is not None:
            return self.warmup
        return 2 if workload == "a" else self.num_users

    def serve_seed(self, workload: str) -> int:
        """A prompt seed per workload: a server that outlives one workload (llama-server, the
        stack) must not meet the same prompts again in the next and serve them from a cache."""
        return self.seed + WORKLOADS.index(workload)

    @property
    def server_ctx_per_slot(self) -> int:
        return round_up(self.input_len + self.output_len + SLOT_MARGIN_TOKENS, CTX_PADDING)

    @property
    def server_ctx(self) -> int:
        return self.num_users * self.server_ctx_per_slot

    @property
    def batched_bench_ctx(self) -> int:
        return round_up(self.offline_batch * (self.input_len + self.output_len), CTX_PADDING)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One column of the table."""

    kind: EngineKind
    model: Path
    quantization: str
    """llama.cpp: the GGUF's type (Q4_0, Q4_1, Q4_K_M); llmserve: its --quantization value."""
    file: str = SHIPPED_QUANT
    """The GGUF's type label: which file the column ran."""
    file_in_title: bool = False
    """llmserve columns name their file when they ran more than one."""
    speculation: bool = True
    """llmserve: the server's default drafting; False runs it with --no-speculation, one
    token per step, as llama-server runs here (the kernels alone, compared)."""

    @property
    def name(self) -> str:
        """Key in the JSON and in file names."""
        if self.kind == "llamacpp":
            return f"llamacpp-{self.quantization.lower()}"
        suffix = f"-{self.file.lower()}" if self.file_in_title else ""
        drafts = "" if self.speculation else "-nospec"
        return f"{self.kind}-{self.quantization}{suffix}{drafts}"

    @property
    def title(self) -> str:
        if self.kind == "llamacpp":
            return f"llama.cpp {self.quantization}"
        stack = " stack" if self.kind == "llmserve-stack" else ""
        suffix = f" {self.file}" if self.file_in_title else ""
        drafts = "" if self.speculation else " no drafts"
        return f"llmserve{stack} {self.quantization}{suffix}{drafts}"

    @property
    def is_llmserve(self) -> bool:
        return self.kind != "llamacpp"

    def runs(self, workload: str) -> bool:
        """The stack is measured on the serving workloads only: offline and prefill runs are
        the engine itself, which the in-process column already covers."""
        return self.kind != "llmserve-stack" or workload in SERVE_WORKLOADS


def parse_list(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [value for value in values if value not in allowed]
    if not values or unknown:
        raise ValueError(f"{flag} takes some of {', '.join(allowed)}; got {text!r}")
    return list(dict.fromkeys(values))


def engine_specs(
    llamacpp_quants: Sequence[str],
    llmserve_quantizations: Sequence[str],
    stack_quantizations: Sequence[str],
    llamacpp_models: Mapping[str, Path],
    llmserve_model: Path,
    llmserve_files: Sequence[str] = (),
    llmserve_drafting: Sequence[bool] = (True,),
) -> list[EngineSpec]:
    """llama.cpp columns first (in `llamacpp_quants` order), then llmserve's in-process
    columns, then the stack's, one per quantization each, and per file of `llmserve_files`
    (default: the shipped file, `llmserve_model`; other labels load `llamacpp_models`); the
    in-process ones once per value of `llmserve_drafting` (False: --no-speculation)."""
    files = list(llmserve_files) or [SHIPPED_QUANT]
    many = len(files) > 1

    def model(file: str) -> Path:
        return llmserve_model if file == SHIPPED_QUANT else llamacpp_models[file]

    specs = [EngineSpec("llamacpp", llamacpp_models[q], q, q) for q in llamacpp_quants]
    specs += [
        EngineSpec("llmserve", model(f), q, f, many, drafting)
        for f in files
        for q in llmserve_quantizations
        for drafting in llmserve_drafting
    ]
    specs += [
        EngineSpec("llmserve-stack", model(f), q, f, many)
        for f in files
        for q in stack_quantizations
    ]
    return specs


# ---- command lines ---------------------------------------------------------------------


def llama_server_command(server: Path, model: Path, port: int, config: PeersConfig) -> list[str]:
    """llama-server as the many-user peer: one slot per user, continuous batching, and no
    prompt reuse across requests (--no-cache-prompt, --cache-ram 0): every request's prompt
    is prefilled, as it is in llmserve for these random, prefix-free prompts."""
    return [
        str(server),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(config.threads),
        "--threads-batch",
        str(config.threads),
        "--parallel",
        str(config.num_users),
        "--ctx-size",
        str(config.server_ctx),
        "--cont-batching",
        "--no-cache-prompt",
        "--cache-ram",
        "0",
    ]


def llama_bench_command(bench: Path, model: Path, config: PeersConfig) -> list[str]:
    """Prompt processing only (-n 0), at each prefill length, JSON on stdout."""
    return [
        str(bench),
        "--model",
        str(model),
        "-p",
        ",".join(str(n) for n in config.prefill_lens),
        "-n",
        "0",
        "--threads",
        str(config.threads),
        "--repetitions",
        str(config.repeats),
        "-o",
        "json",
    ]


def batched_bench_command(batched_bench: Path, model: Path, config: PeersConfig) -> list[str]:
    """One batch of `offline_batch` sequences, each its own prompt (no -pps)."""
    return [
        str(batched_bench),
        "--model",
        str(model),
        "--ctx-size",
        str(config.batched_bench_ctx),
        "-npp",
        str(config.input_len),
        "-ntg",
        str(config.output_len),
        "-npl",
        str(config.offline_batch),
        "--threads",
        str(config.threads),
        "--threads-batch",
        str(config.threads),
        "--output-format",
        "jsonl",
    ]


def _llmserve_engine_flags(engine: EngineSpec, config: PeersConfig) -> list[str]:
    flags = ["--model", str(engine.model), "--quantization", engine.quantization]
    flags += ["--threads", str(config.threads)]
    flags += [] if engine.speculation else ["--no-speculation"]
    return flags + (["--enforce-eager"] if config.enforce_eager else [])


def serve_command(
    python: str, engine: EngineSpec, target: str, config: PeersConfig, workload: str, out: Path
) -> list[str]:
    """`bench serve` for workload a or b. Token-id prompts (--dataset synthetic) for every
    target: llama-server takes them too, so both sides see the same 128 ids, not text that
    each tokenizer might cut differently."""
    # `python -m benchmarks.serve` is `llmserve bench serve` without importing every other
    # subcommand, so a half-edited module elsewhere in the tree cannot stop the client.
    command = [python, "-m", "benchmarks.serve", "--target", target]
    command += ["--dataset", "synthetic", "--input-len", str(config.input_len)]
    command += ["--output-len", str(config.output_len)]
    command += ["--seed", str(config.serve_seed(workload))]
    command += ["--concurrency", str(config.serve_concurrency(workload))]
    command += ["--num-prompts", str(config.serve_prompts(workload))]
    command += ["--warmup", str(config.serve_warmup(workload)), "--json-out", str(out)]
    if target == "inprocess":
        # As many sequences as llama-server has slots, for a and b alike (one engine shape).
        command += _llmserve_engine_flags(engine, config)
        command += ["--dtype", config.dtype, "--max-num-seqs", str(config.num_users)]
    return command


def offline_command(
    python: str, engine: EngineSpec, config: PeersConfig, workload: str, out: Path
) -> list[str]:
    """`bench offline` for workload c (one batch) or d (batch 1, one output token: the time
    to the first token is the prefill)."""
    if workload == "c":
        batch, shapes = config.offline_batch, f"{config.input_len}x{config.output_len}"
    else:
        batch, shapes = 1, ",".join(f"{n}x1" for n in config.prefill_lens)
    command = [python, "-m", "benchmarks.offline_table", "--dtypes", config.dtype]
    command += ["--batch-sizes", str(batch), "--shapes", shapes]
    command += ["--repeats", str(config.repeats), "--json-out", str(out)]
    return command + _llmserve_engine_flags(engine, config)


def stack_flags(engine: EngineSpec, config: PeersConfig) -> list[str]:
    """`llmserve up` flags for the stack column: the in-process column's settings (its
    workers get the compute threads)."""
    return stack_up_flags(
        model=str(engine.model),
        dtype=config.dtype,
        quantization=engine.quantization,
        threads=config.threads,
        max_num_seqs=config.num_users,
        enforce_eager=config.enforce_eager,
    )


# ---- parsing the tools' output -----------------------------------------------------------


def _json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in `text`, whether it holds one array (`-o json`), one object per
    line (JSONL) or either among log lines: a value is decoded wherever a line starts with
    '[' or '{', and lines that do not decode (log lines such as '[1/3] ...') are skipped."""
    decoder = json.JSONDecoder()
    objects: list[dict[str, Any]] = []
    decoded_until = 0
    for match in re.finditer(r"^[ \t]*[\[{]", text, re.MULTILINE):
        start = match.end() - 1
        if start < decoded_until:
            continue  # inside a value already decoded
        try:
            value, decoded_until = decoder.raw_decode(text, start)
        except ValueError:
            continue
        items = value if isinstance(value, list) else [value]
        objects += [item for item in items if isinstance(item, dict)]
    return objects


def parse_llama_bench(text: str) -> dict[int, float]:
    """Prompt tokens/s by prompt length from `llama-bench -o json` (or -o jsonl): the
    median of the per-repetition samples (`samples_ts`), else `avg_ts`. Generation tests
    (n_gen > 0) are left out."""
    speeds: dict[int, float] = {}
    for test in _json_objects(text):
        n_prompt = int(test.get("n_prompt") or 0)
        if n_prompt <= 0 or int(test.get("n_gen") or 0) != 0:
            continue
        samples = [float(s) for s in test.get("samples_ts") or [] if s is not None]
        speed = median(samples) if samples else float(test.get("avg_ts", math.nan))
        speeds[n_prompt] = speed
    return speeds


@dataclass(frozen=True, slots=True)
class BatchedBenchRow:
    """One (prompt, generation, parallel) line of llama-batched-bench. It prefills `pl`
    prompts of `pp` tokens, then runs `tg` decode steps of `pl` tokens each; times in s."""

    pp: int
    tg: int
    pl: int
    t_pp_s: float
    t_tg_s: float
    t_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        """Generated tokens over the whole time, prefill included (as `bench offline`)."""
        return self.pl * self.tg / self.t_s

    @property
    def total_tokens_per_s(self) -> float:
        return self.pl * (self.pp + self.tg) / self.t_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.pl * self.tg / self.t_tg_s


BATCHED_BENCH_MD_ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*"  # PP, TG, B, N_KV
    r"\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*"  # T_PP, S_PP, T_TG, S_TG
    r"\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*$"  # T, S
)


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    """Rows from llama-batched-bench's `--output-format jsonl` or its default markdown table,
    whichever the text holds; log lines around them are skipped."""
    rows = []
    for item in _json_objects(text):
        if not {"pp", "tg", "pl", "t_pp", "t_tg", "t"} <= item.keys():
            continue
        known = {"pp", "tg", "pl", "t_pp", "t_tg", "t"}
        rows.append(
            BatchedBenchRow(
                pp=int(item["pp"]),
                tg=int(item["tg"]),
                pl=int(item["pl"]),
                t_pp_s=float(item["t_pp"]),
                t_tg_s=float(item["t_tg"]),
                t_s=float(item["t"]),
                extra={k: v for k, v in item.items() if k not in known},
            )
        )
    if rows:
        return rows
    for line in text.splitlines():
        match = BATCHED_BENCH_MD_ROW.match(line.strip())
        if match:
            pp, tg, pl, _, t_pp, _, t_tg, _, t, _ = match.groups()
            rows.append(
                BatchedBenchRow(int(pp), int(tg), int(pl), float(t_pp), float(t_tg), float(t))
            )
    return rows


# ---- measures from each run ------------------------------------------------------------


def serve_measures(document: Mapping[str, Any], workload: str) -> dict[str, float]:
    """Workload a or b's measures from a `bench serve --json-out` document."""
    summary = document["points"][0]["summary"]

    def p50(metric: str) -> float:
        value = (summary.get(metric) or {}).get("p50_ms")
        return math.nan if value is None else float(value)

    if workload == "a":
        return {"a_tpot_ms": p50("tpot"), "a_ttft_ms": p50("ttft")}
    tok_s = summary.get("output_tokens_per_s")
    return {
        "b_output_tok_s": math.nan if tok_s is None else float(tok_s),
        "b_ttft_ms": p50("ttft"),
    }


def serve_checks(document: Mapping[str, Any], config: PeersConfig) -> list[str]:
    """What would make a serving run unfair: failures, a request that did not get exactly the
    prompt and output lengths asked for, prompt tokens served from a cache."""
    point = document["points"][0]
    requests = point.get("requests") or []
    problems = []
    failed = [r for r in requests if r.get("error")]
    if failed:
        errors = sorted({str(r["error"]) for r in failed})
        problems.append(f"{len(failed)} of {len(requests)} requests failed: {', '.join(errors)}")
    done = [r for r in requests if not r.get("error")]
    wrong_output = [r["output_tokens"] for r in done if r["output_tokens"] != config.output_len]
    if wrong_output:
        problems.append(
            f"{len(wrong_output)} requests got {sorted(set(wrong_output))} output tokens, "
            f"not {config.output_len}"
        )
    wrong_prompt = [r["prompt_tokens"] for r in done if r["prompt_tokens"] != config.input_len]
    if wrong_prompt:
        problems.append(
            f"{len(wrong_prompt)} prompts counted {sorted(set(wrong_prompt))} tokens by the "
            f"server, not {config.input_len}"
        )
    cached = sum(int(r.get("cached_prompt_tokens") or 0) for r in done)
    if cached:
        problems.append(f"{cached} prompt tokens were served from a cache")
    return problems


def offline_measures(
    document: Mapping[str, Any], config: PeersConfig, workload: str
) -> dict[str, float]:
    """Workload c or d's measures from a `bench offline --json-out` document. c also gets
    the decode-only speed (batch / median pure-decode step), kept in the JSON beside
    llama-batched-bench's S_TG; the table shows the whole-run speeds."""
    values: dict[str, float] = {}
    for cell in document.get("cells", []):
        result = cell["median"]
        if workload == "c" and (
            cell["batch_size"],
            cell["input_len"],
            cell["output_len"],
        ) == (config.offline_batch, config.input_len, config.output_len):
            values["c_output_tok_s"] = float(result["output_tokens_per_s"])
            values["c_total_tok_s"] = float(result["total_tokens_per_s"])
            decode_ms = float(result.get("decode_ms_per_step") or math.nan)
            values["c_decode_tok_s"] = 1e3 * config.offline_batch / decode_ms
        if workload == "d" and cell["batch_size"] == 1 and cell["input_len"] in config.prefill_lens:
            prefill_ms = float(result["prefill_ms"])
            tok_s = 1e3 * cell["input_len"] / prefill_ms if prefill_ms > 0 else math.nan
            values[f"d_prefill_{cell['input_len']}_tok_s"] = tok_s
    return values


def batched_bench_measures(
    rows: Sequence[BatchedBenchRow], config: PeersConfig
) -> dict[str, float]:
    for row in rows:
        if (row.pp, row.tg, row.pl) == (config.input_len, config.output_len, config.offline_batch):
            return {
                "c_output_tok_s": row.output_tokens_per_s,
                "c_total_tok_s": row.total_tokens_per_s,
                "c_decode_tok_s": row.decode_tokens_per_s,
            }
    return {}


def llama_bench_measures(speeds: Mapping[int, float], config: PeersConfig) -> dict[str, float]:
    return {f"d_prefill_{n}_tok_s": speeds[n] for n in config.prefill_lens if n in speeds}
