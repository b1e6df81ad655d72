"""Service boundaries: the import-linter contracts in pyproject.toml hold, and the tokenizer
tier runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
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


def test_the_benchmarks_stay_outside_the_service_package() -> None:
    """The contracts that keep `benchmarks` a package above the services exist (the test above
    checks that they hold), and a source install still ships it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    linter = project["tool"]["importlinter"]
    assert {"services", "kernels", "protos", "benchmarks"} <= set(linter["root_packages"])
    contracts = {contract["name"]: contract for contract in linter["contracts"]}
    never = contracts["No service, kernel or proto module imports the benchmarks"]
    assert never["type"] == "forbidden"
    assert set(never["source_modules"]) == {"services", "kernels", "protos"}
    assert never["forbidden_modules"] == ["benchmarks"]
    assert not never.get("ignore_imports")
    layers = contracts["Layers: the benchmarks sit above the services"]
    assert layers["type"] == "layers" and layers["layers"] == ["benchmarks", "services"]
    assert "services.bench" not in str(linter)
    assert "benchmarks*" in project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not (ROOT / "services" / "bench").exists()


def test_tokenizer_tier_never_imports_torch() -> None:
    # The process's own entry point first: `llmserve tokenizer` parses its command line with
    # services.cli, which must not build (and import) the other commands' parsers.
    code = """
import sys
from services import cli

cli.build_parser(cli.command_of(["--log-level", "INFO", "tokenizer", "--port", "0"]))
from services.common.model_source import embedded_model_path
from services.text.model_tokenizer import ModelTokenizer
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
