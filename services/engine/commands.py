"""The in-process engine's commands: `llmserve offline` (JSONL batch inference) and
`llmserve demo` (one streamed chat answer in the terminal)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services.engine.config import EngineConfig
from services.worker.config import GiB


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The in-process engine's flags, one per EngineConfig field (defaults live there), plus
    the older spellings these commands accepted before (deprecated)."""
    from services.common.config_flags import add_config_flags, add_deprecated_flag

    add_config_flags(parser, EngineConfig)
    # Older spellings, one line each saying which to use.
    add_deprecated_flag(
        parser,
        "--kv-cache-bytes",
        dest="kv_cache_gib",
        instead="--kv-cache-gib",
        convert=lambda value: int(value) / GiB,
    )
    add_deprecated_flag(parser, "--num-threads", dest="threads", instead="--threads", convert=int)
    add_deprecated_flag(
        parser,
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        instead="--no-enable-prefix-caching",
        const=False,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from services.common.config_flags import config_from_args

    return config_from_args(EngineConfig, args)


def cmd_offline(args: argparse.Namespace) -> int:
    from services.engine.engine import LLMEngine
    from services.engine.offline import run_offline

    engine = LLMEngine(engine_config(args))
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
    from services.contracts.sampling_params import SamplingParams
    from services.engine.engine import LLMEngine
    from services.text.chat_template import ChatMessage
    from services.text.detokenizer import IncrementalDetokenizer

    engine = LLMEngine(engine_config(args))
    prompt = engine.tokenizer.apply_chat_template([ChatMessage("user", args.prompt)])
    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    engine.add_request(prompt, sampling)
    print(f"[{engine.model_name}, {engine.dtype}] {args.prompt}\n", file=sys.stderr)
    # A sliding window of ids per token (never the whole output again), and no half
    # characters: the tokenizer tier's own streaming detokenizer.
    detokenizer = IncrementalDetokenizer(engine.tokenizer, prompt)
    for event in engine.stream():
        sys.stdout.write(detokenizer.add(event.new_token_ids))
        if event.finished:
            sys.stdout.write(detokenizer.finish())
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def add_offline_parser(sub: Any) -> None:
    offline = sub.add_parser(
        "offline", help="batch inference: JSONL requests in, JSONL results out"
    )
    offline.add_argument("--input", required=True, help="requests.jsonl")
    offline.add_argument("--output", required=True, help="results.jsonl")
    offline.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_flags(offline)
    offline.set_defaults(func=cmd_offline)


def add_demo_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="stream one answer from the in-process engine")
    demo.add_argument(
        "prompt", nargs="?", default="What is the capital of France? Answer in one sentence."
    )
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    add_engine_flags(demo)
    demo.set_defaults(func=cmd_demo)
