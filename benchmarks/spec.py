"""`llmserve bench spec`: what speculative decoding buys on the in-process engine, by kind of
traffic and number of users: speculation off (`off`, the server's --no-speculation), the
server's defaults (`default`: both proposers, at their default sizes), prompt lookup alone
(`ngram`) and with the suffix cache too (`suffix`; --num-speculative-tokens and
--suffix-cache-tokens size these two).

    llmserve bench spec --users 1,4,16 --rounds 3 --output-len 128

Workloads (spec_workload.py): code edits, multi-turn chat quoting earlier turns, JSON
extraction under a schema, plain chat. The model is loaded once; each mode gets its own engine,
warmed by one round of every workload (a different seed: the suffix cache then holds earlier
traffic of each kind, as a serving worker's would, never the answers measured). A round sends
`users` greedy requests at once and runs them to the end; the table holds medians over rounds
of output tok/s (tokens / wall time), ms per token as each user sees it (wall time / the mean
answer length), decode ms per token (TPOT: a request's time from its first token to its last
over the tokens after the first, averaged over requests), and tokens per speculating step
(1 + accepted / sequence-steps that verified drafts, from the scheduler's counters), with the
speed-ups over `off` of tok/s and of decode time. Speculation only shortens decoding: the
prompt's prefill is in tok/s and ms/token but not in the decode figures, so the two speed-ups
part where prompts are long against the answers. The scheduler's own policy decides who
drafts (drafts are granted only while they pay), as in serving.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from benchmarks.common import command_line, cpu_model_name, format_table, load_average
from benchmarks.serve_metrics import Chunk, RequestRecord
from benchmarks.spec_workload import WORKLOADS, SpecRequest, workload_requests
from services.common.serving_config import DEFAULT_SPECULATIVE_NGRAM, DEFAULT_SUFFIX_CACHE_TOKENS
from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel

MODES = ("off", "default", "ngram", "suffix")
WARMUP_SEED = 99_991
HEADERS = (
    "workload",
    "users",
    "mode",
    "tok/s",
    "ms/token",
    "decode ms/token",
    "tokens/step",
    "accepted",
    "speed-up",
    "decode speed-up",
)


def decode_ms_per_token(records: Iterable[RequestRecord]) -> float:
    """Mean TPOT over requests in ms (serve_metrics' RequestRecord.tpot_s: the time per output
    token after the first, as a streaming user sees it). Requests of one token have no decode
    and are left out (0.0 when none has two)."""
    per_request = [1000 * tpot for r in records if (tpot := r.tpot_s) is not None]
    return statistics.mean(per_request) if per_request else 0.0


@dataclass(slots=True)
class Round:
    output_tok_s: float
    ms_per_token: float
    decode_ms_per_token: float
    tokens_per_step: float
    acceptance: float


@dataclass(slots=True)
class Cell:
    rounds: list[Round] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.rounds)


def engine_config(mode: str, args: argparse.Namespace) -> EngineConfig:
    common = {"seed": 0, "kv_cache_gib": args.kv_cache_gib}
    if mode == "off":
        return EngineConfig(speculation=False, **common)
    if mode == "default":
        return EngineConfig(**common)
    return EngineConfig(
        speculation=True,  # whatever the weights (unset: only on a batch-invariant engine)
        speculative_ngram=args.num_speculative_tokens,
        speculative_suffix_cache_tokens=args.suffix_cache_tokens if mode == "suffix" else 0,
        **common,
    )


def run_round(engine: LLMEngine, requests: list[SpecRequest], output_len: int) -> Round:
    prompts = [engine.tokenizer.apply_chat_template(r.messages) for r in requests]
    before = engine.get_stats()
    start = time.perf_counter()
    request_ids = [
        engine.add_request(
            prompt,
            SamplingParams(
                temperature=0.0, max_new_tokens=output_len, structured_output=r.structured_output
            ),
        )
        for prompt, r in zip(prompts, requests, strict=True)
    ]
    records = {request_id: RequestRecord(send_time_s=start) for request_id in request_ids}
    for event in engine.stream():
        record = records.get(event.request_id)
        if record is None or not event.new_token_ids:
            continue
        now = time.perf_counter()
        record.chunks.append(Chunk(now, len(event.new_token_ids)))
        record.end_time_s = now
        record.output_tokens += len(event.new_token_ids)
    wall_s = time.perf_counter() - start
    after = engine.get_stats()
    lengths = [r.output_tokens for r in records.values()]
    proposed = after.num_draft_tokens_proposed - before.num_draft_tokens_proposed
    accepted = after.num_draft_tokens_accepted - before.num_draft_tokens_accepted
    steps = after.num_speculative_steps - before.num_speculative_steps
    return Round(
        output_tok_s=sum(lengths) / wall_s,
        ms_per_token=1000 * wall_s / max(1.0, statistics.mean(lengths)),
        decode_ms_per_token=decode_ms_per_token(records.values()),
        tokens_per_step=1 + accepted / steps if steps else 1.0,
        acceptance=accepted / proposed if proposed else 0.0,
    )


def table_rows(cells: dict[tuple[str, int, str], Cell]) -> list[list[object]]:
    rows: list[list[object]] = []
    for (workload, users, mode), cell in cells.items():
        off = cells.get((workload, users, "off"))
        tok_s = cell.median("output_tok_s")
        decode_ms = cell.median("decode_ms_per_token")
        speed_up = f"{tok_s / off.median('output_tok_s'):.2f}x" if off else "-"
        decode_speed_up = (
            f"{off.median('decode_ms_per_token') / decode_ms:.2f}x" if off and decode_ms else "-"
        )
        rows.append(
            [
                workload,
                users,
                mode,
                round(tok_s, 1),
                round(cell.median("ms_per_token"), 1),
                round(decode_ms, 2),
                round(cell.median("tokens_per_step"), 2),
                f"{100 * cell.median('acceptance'):.0f}%",
                speed_up,
                decode_speed_up,
            ]
        )
    return rows


def parse_list(text: str, name: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{name} is empty")
    return items


def run(args: argparse.Namespace) -> int:
    workloads = parse_list(args.workloads, "--workloads")
    for workload in workloads:
        if workload not in WORKLOADS:
            raise SystemExit(
                f"--workloads: each is one of {', '.join(WORKLOADS)}, got {workload!r}"
            )
    modes = parse_list(args.modes, "--modes")
    if any(mode not in MODES for mode in modes):
        raise SystemExit(f"--modes: each is one of {', '.join(MODES)}, got {args.modes!r}")
    users = [int(u) for u in parse_list(args.users, "--users")]
    if any(u < 1 for u in users):
        raise SystemExit("--users: each must be >= 1")
    print(f"{command_line()}\n\ncpu: {cpu_model_name()}; load: {load_average()}\n")
    import torch

    loaded = LoadedModel.load(args.model, torch.float32, quantization=args.quantization)
    cells: dict[tuple[str, int, str], Cell] = {}
    for mode in modes:
        engine = LLMEngine(engine_config(mode, args), loaded=loaded)
        for workload in workloads:
            warm = workload_requests(workload, max(users), WARMUP_SEED)
            run_round(engine, warm, args.output_len)
        for workload in workloads:
            for count in users:
                cell = cells.setdefault((workload, count, mode), Cell())
                for index in range(args.rounds):
                    requests = workload_requests(workload, count, seed=index)
                    cell.rounds.append(run_round(engine, requests, args.output_len))
                print(f"  {mode} {workload} x{count} done", file=sys.stderr)
    ordered = dict(sorted(cells.items(), key=lambda item: (item[0][0], item[0][1])))
    print(format_table(HEADERS, table_rows(ordered)))
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {WORKLOADS}")
    parser.add_argument("--users", default="1,4,16", help="comma-separated requests at once")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {MODES}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128, help="most tokens per answer")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=DEFAULT_SPECULATIVE_NGRAM,
        help="most drafts per step in the ngram and suffix modes",
    )
    parser.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=DEFAULT_SUFFIX_CACHE_TOKENS,
        help="the suffix cache's budget in the suffix mode",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--model", default=None, help="a GGUF or HF model (default: embedded)")
    parser.add_argument("--quantization", default="gguf-exact")
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "spec",
        help="speculation off, the defaults, n-gram and suffix decoding on code, chat and JSON",
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench spec")
    configure_parser(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
