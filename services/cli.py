"""The `llmserve` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from services.common.logging import configure_logging


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The in-process engine's flags, one per EngineConfig field (defaults live there), plus
    the older spellings these commands have always accepted."""
    from services.common.config_flags import add_config_flags
    from services.engine.config import EngineConfig
    from services.worker.config import GiB

    add_config_flags(parser, EngineConfig)
    # Aliases: default=SUPPRESS, so only a given flag writes the field.
    parser.add_argument(
        "--kv-cache-gib",
        dest="kv_cache_bytes",
        type=lambda value: int(float(value) * GiB),
        default=argparse.SUPPRESS,
        metavar="GIB",
        help="--kv-cache-bytes in GiB",
    )
    parser.add_argument(
        "--threads",
        dest="num_threads",
        type=int,
        default=argparse.SUPPRESS,
        metavar="N",
        help="--num-threads",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=argparse.SUPPRESS,
        help="--no-enable-prefix-caching",
    )


def _engine_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.common.config_flags import config_from_args
    from services.engine.config import EngineConfig

    return config_from_args(EngineConfig, args)


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


# Commands whose processes must stay light (a tokenizer replica is scaled by the dozen; `inspect`
# answers from metadata in seconds): their command line is built alone, so the process never
# imports the worker's, the engine's or the benchmarks' modules, and with them torch.
LIGHT_COMMANDS = {
    "tokenizer": "services.tokenizer.server",
    "scheduler": "services.scheduler.server",
    "inspect": "services.inspect_command",
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

    from services import build_kernels_command, client, inspect_command, launcher
    from services.scheduler import server as scheduler_server
    from services.tokenizer import server as tokenizer_server
    from services.worker import server as worker_server

    worker_server.add_parser(sub)
    scheduler_server.add_parser(sub)
    tokenizer_server.add_parser(sub)
    client.add_parser(sub)
    client.add_prompts_parser(sub)
    launcher.add_parser(sub)
    inspect_command.add_parser(sub)
    build_kernels_command.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # Imported here: the benchmarks pull in modules the services never need.
    from services.bench import (
        capacity,
        detokenize,
        estimate_command,
        hf_baseline,
        interleaved,
        offline_table,
        peers,
        prefix_cache,
        quant_table,
        serve,
        speculative,
        step_profile,
        structured,
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
        structured,
        detokenize,
        interleaved,
        speculative,
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
