"""Service boundaries: the import-linter contracts in pyproject.toml hold, and the tokenizer
tier runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """This checkout first on the path, whatever the installed package points at."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_import_contracts_hold() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command;"
            " sys.exit(lint_imports_command())",
            "--no-cache",
            "--no-logo",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_tokenizer_tier_never_imports_torch() -> None:
    # The process's own entry point first: `llmserve tokenizer` parses its command line with
    # services.cli, which must not build (and import) the other commands' parsers.
    code = """
import sys
from services import cli

cli.build_parser(cli.command_of(["--log-level", "INFO", "tokenizer", "--port", "0"]))
from services.common.model_source import embedded_model_path
from services.common.model_tokenizer import ModelTokenizer
from services.tokenizer import server

file_tokenizer = ModelTokenizer.from_path(embedded_model_path())
description = file_tokenizer.describe(
    model_name="m", vocab_size=file_tokenizer.vocab_size, max_model_len=64, eos_token_ids=()
)
model = server.ServedModel.from_description(description)
assert model.tokenizer.encode("Hello") and model.max_model_len > 0 and model.vocab_size > 0
torch = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(torch)
"""
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


def test_the_command_line_finds_its_command() -> None:
    from services import cli

    assert cli.command_of(["tokenizer", "--port", "0"]) == "tokenizer"
    assert cli.command_of(["--log-level", "DEBUG", "scheduler"]) == "scheduler"
    assert cli.command_of(["--log-level=DEBUG", "up"]) == "up"
    assert cli.command_of(["--help"]) is None
    # A light command's parser knows only that command; the full one knows them all.
    light = cli.build_parser("tokenizer").parse_args(["tokenizer", "--port", "0"])
    assert light.command == "tokenizer"
    full = cli.build_parser(None).parse_args(["up", "--help"][:1])
    assert full.command == "up"
