"""The `llmserve` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from services.common.logging import configure_logging

# Every command: the module that defines it, the function adding its parser, and its one-line
# help for `llmserve --help`. A command line imports only its own command's module, so
# client commands (`chat`, `generate`, `prompts`) and `--help` never load torch, a tokenizer
# replica never loads the worker's modules, and only `bench` loads the benchmarks (by name:
# no service imports the `benchmarks` package).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("services.launcher", "add_parser", "start the whole stack as local processes"),
    "worker": ("services.worker.server", "add_parser", "run the worker service"),
    "scheduler": ("services.scheduler.server", "add_parser", "run the scheduler service"),
    "tokenizer": (
        "services.tokenizer.server",
        "add_parser",
        "run the tokenizer service (the public gRPC and HTTP API)",
    ),
    "chat": ("services.client", "add_parser", "stream a chat answer from a running server"),
    "generate": (
        "services.client",
        "add_parser",
        "stream a raw completion (text or token ids) from a running server",
    ),
    "prompts": (
        "services.client",
        "add_prompts_parser",
        "named system prompts: register, list, delete (on a running server)",
    ),
    "offline": (
        "services.engine.commands",
        "add_offline_parser",
        "batch inference: JSONL requests in, JSONL results out",
    ),
    "demo": (
        "services.engine.commands",
        "add_demo_parser",
        "stream one answer from the in-process engine",
    ),
    "inspect": ("services.inspect_command", "add_parser", "what a model file holds and needs"),
    "build-kernels": (
        "services.build_kernels_command",
        "add_parser",
        "build the C++ CPU kernels ahead of the first start",
    ),
    "bench": ("benchmarks.commands", "add_parser", "benchmarks"),
    "estimate": (
        "services.estimate.command",
        "add_parser",
        "the seeds' hardware table and this CPU's decode speed of light",
    ),
}

# Packages an install may lack (the service image ships `services` alone), and how to get them.
OPTIONAL_PACKAGES: dict[str, str] = {
    "benchmarks": "the benchmarks are not installed: run llmserve from a source checkout "
    "(`pip install -e .` in it installs them too)",
}


def missing_package_hint(module: str, error: ModuleNotFoundError) -> str | None:
    """What to tell the user when importing `module` failed because its optional package is
    absent (None: another module is missing, a real error)."""
    package = module.partition(".")[0]
    missing = error.name or ""
    absent = module == missing or module.startswith(missing + ".")
    return OPTIONAL_PACKAGES.get(package) if missing and absent else None


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand in `argv` (the first word that is neither an option nor its value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _top_parser() -> tuple[argparse.ArgumentParser, Any]:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    # From the environment too, so `llmserve up`'s child processes log at the same level.
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LLMSERVE_LOG_LEVEL", "WARNING"),
        help="DEBUG, INFO, WARNING, ERROR (env LLMSERVE_LOG_LEVEL)",
    )
    return parser, parser.add_subparsers(dest="command", required=True)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """`command`'s parser alone (its module imported, no other), or every command's when
    `command` is None. A command whose optional package is absent exits with status 2 and one
    line saying how to get it; the full parser lists it as not installed."""
    parser, sub = _top_parser()
    added: set[tuple[str, str]] = set()
    for name, (module, adder, help_text) in COMMANDS.items():
        if (command is None or name == command) and (module, adder) not in added:
            try:
                loaded = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                hint = missing_package_hint(module, exc)
                if hint is None:
                    raise
                if command is not None:  # the one line, no traceback: status 2, as argparse
                    print(f"llmserve {name}: {hint}", file=sys.stderr)
                    raise SystemExit(2) from None
                sub.add_parser(name, help=f"{help_text} (not installed)", add_help=False)
                continue
            getattr(loaded, adder)(sub)
            added.add((module, adder))
    return parser


def listing_parser() -> argparse.ArgumentParser:
    """Every command by name and help only, importing none of them: what `llmserve --help`
    and a mistyped command need."""
    parser, sub = _top_parser()
    for name, (_, _, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    command = command_of(argv)
    return build_parser(command) if command in COMMANDS else listing_parser()


def main(argv: Sequence[str] | None = None) -> int:
    parser = parser_for(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the user sees one line, not a traceback, for our own errors
        from services.contracts.errors import LLMServeError

        if isinstance(exc, LLMServeError):
            logging.getLogger("llmserve").debug("failed", exc_info=True)
            print(f"llmserve: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
