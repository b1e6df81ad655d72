"""The `llmserve` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from services.common.logging import configure_logging


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="memory for the paged KV cache"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model dtype) or int8 (per-group scales, more sequences per GiB)",
    )
    parser.add_argument(
        "--kv-cache-group-size", type=int, default=8, help="int8 KV: values per scale"
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help="weights: auto (the file's own format), none, int8, w8a8, int4, nf4, gguf"
        " (see docs/quantization.md)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (no compiled decode graphs): slower, starts faster",
    )


def _engine_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.engine.config import EngineConfig
    from services.worker.config import GiB

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_bytes=int(args.kv_cache_gib * GiB),
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_group_size=args.kv_cache_group_size,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        num_threads=args.threads,
        enforce_eager=args.enforce_eager,
    )


def cmd_offline(args: argparse.Namespace) -> int:
    from services.engine.engine import LLMEngine
    from services.engine.offline import run_offline

    engine = LLMEngine(_engine_config(args))
    with (
        open(args.input, encoding="utf-8") as source,
        open(args.output, "w", encoding="utf-8") as sink,
    ):
        failures = run_offline(engine, source, sink, show_progress=not args.quiet)
    if failures:
        print(
            f"{failures} request(s) failed; see their 'error' objects in {args.output}",
            file=sys.stderr,
        )
        return 3
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Stream one chat answer from the in-process engine to the terminal."""
    from services.common.chat_template import ChatMessage
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import LLMEngine

    engine = LLMEngine(_engine_config(args))
    prompt = engine.tokenizer.apply_chat_template([ChatMessage("user", args.prompt)])
    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    engine.add_request(prompt, sampling)
    print(f"[{engine.model_name}, {engine.dtype}] {args.prompt}\n", file=sys.stderr)
    tokens: list[int] = []
    shown = ""
    for event in engine.stream():
        tokens.extend(event.new_token_ids)
        text = engine.tokenizer.decode(tokens)
        # Hold back a trailing replacement character: a multi-byte character may be half done.
        if not text.endswith("\ufffd") or event.finished:
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return 0


# Services whose processes must stay light (a tokenizer replica is scaled by the dozen): their
# command line is built alone, so the process never imports the worker's, the engine's or the
# benchmarks' modules, and with them torch.
LIGHT_COMMANDS = {
    "tokenizer": "services.tokenizer.server",
    "scheduler": "services.scheduler.server",
}


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand in `argv` (the first word that is neither an option nor its value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; only `command`'s when it is one of LIGHT_COMMANDS."""
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    # From the environment too, so `llmserve up`'s child processes log at the same level.
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LLMSERVE_LOG_LEVEL", "WARNING"),
        help="DEBUG, INFO, WARNING, ERROR (env LLMSERVE_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    if command in LIGHT_COMMANDS:
        import importlib

        importlib.import_module(LIGHT_COMMANDS[command]).add_parser(sub)
        return parser

    offline = sub.add_parser(
        "offline", help="batch inference: JSONL requests in, JSONL results out"
    )
    offline.add_argument("--input", required=True, help="requests.jsonl")
    offline.add_argument("--output", required=True, help="results.jsonl")
    offline.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_flags(offline)
    offline.set_defaults(func=cmd_offline)

    demo = sub.add_parser("demo", help="stream one answer from the in-process engine")
    demo.add_argument(
        "prompt", nargs="?", default="What is the capital of France? Answer in one sentence."
    )
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    _add_engine_flags(demo)
    demo.set_defaults(func=cmd_demo)

    from services import client, launcher
    from services.scheduler import server as scheduler_server
    from services.tokenizer import server as tokenizer_server
    from services.worker import server as worker_server

    worker_server.add_parser(sub)
    scheduler_server.add_parser(sub)
    tokenizer_server.add_parser(sub)
    client.add_parser(sub)
    client.add_prompts_parser(sub)
    launcher.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # Imported here: the benchmarks pull in modules the services never need.
    from services.bench import (
        capacity,
        estimate_command,
        hf_baseline,
        offline_table,
        peers,
        prefix_cache,
        quant_table,
        serve,
        step_profile,
    )

    for benchmark in (
        offline_table,
        capacity,
        hf_baseline,
        serve,
        prefix_cache,
        quant_table,
        peers,
        step_profile,
    ):
        benchmark.add_parser(bench_sub)
    estimate_command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(command_of(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the user sees one line, not a traceback, for our own errors
        from services.common.errors import LLMServeError

        if isinstance(exc, LLMServeError):
            logging.getLogger("llmserve").debug("failed", exc_info=True)
            print(f"llmserve: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
