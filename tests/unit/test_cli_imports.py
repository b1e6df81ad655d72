"""The client-side commands start light: `llmserve --help`, `chat`, `generate` and `prompts`
(and `up`, `inspect`, `estimate`, the tokenizer and scheduler processes) never import torch, so they
answer in a fraction of a second instead of the seconds torch's import takes."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from services import cli
from services.cli import COMMANDS, build_parser, listing_parser, parser_for

LIGHT = [
    ["--help"],
    ["chat", "--help"],
    ["generate", "--help"],
    ["prompts", "--help"],
    ["tokenizer", "--help"],
    ["scheduler", "--help"],
    ["inspect", "--help"],
    ["up", "--help"],
    ["estimate", "--help"],
]


def imported_modules(argv: list[str]) -> set[str]:
    """Every module `python -X importtime -m services.cli ARGV` imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modules = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    assert "services.common.logging" in modules  # the report really lists our imports
    return modules


@pytest.mark.parametrize("argv", LIGHT, ids=[" ".join(a) for a in LIGHT])
def test_light_commands_never_import_torch(argv: list[str]) -> None:
    modules = imported_modules(argv)
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}


def test_a_heavy_command_does_import_torch() -> None:
    """The check above would see torch if it came: `demo` loads the engine."""
    assert "torch" in imported_modules(["demo", "--help"])


def test_the_listing_names_every_command_and_a_typo_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        parser_for(["--help"]).parse_args(["--help"])
    assert done.value.code == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in COMMANDS)
    with pytest.raises(SystemExit) as refused:
        listing_parser().parse_args(["chta"])
    assert refused.value.code == 2
    assert "invalid choice: 'chta'" in capsys.readouterr().err


def test_each_command_parser_builds_alone_and_all_together() -> None:
    for name in COMMANDS:
        parser = build_parser(name)
        assert name in parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    every = build_parser()
    assert set(COMMANDS) <= set(every._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


# A product install without the benchmarks package: its import fails as if it were absent.
WITHOUT_BENCHMARKS = """
import runpy, sys

class NoBenchmarks:
    def find_spec(self, name, path=None, target=None):
        if name == "benchmarks" or name.startswith("benchmarks."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoBenchmarks())
sys.argv = ["llmserve", *sys.argv[1:]]
runpy.run_module("services.cli", run_name="__main__")
"""


@pytest.mark.parametrize("argv", [["bench", "serve", "--concurrency", "4"], ["bench", "--help"]])
def test_bench_without_the_benchmarks_says_how_to_get_them(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_BENCHMARKS, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("llmserve bench: the benchmarks are not installed")
    assert "source checkout" in line and "pip install -e ." in line


def test_only_the_optional_package_itself_missing_is_explained() -> None:
    def missing(name: str) -> ModuleNotFoundError:
        return ModuleNotFoundError(f"No module named {name!r}", name=name)

    assert cli.missing_package_hint("benchmarks.commands", missing("benchmarks"))
    assert cli.missing_package_hint("benchmarks.commands", missing("benchmarks.commands"))
    # A dependency missing inside the benchmarks, or a service module, is a real error.
    assert cli.missing_package_hint("benchmarks.commands", missing("matplotlib")) is None
    assert cli.missing_package_hint("benchmarks.commands", missing("benchmarks.serve")) is None
    assert cli.missing_package_hint("services.client", missing("services.client")) is None


def test_the_full_parser_lists_an_absent_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = cli.importlib.import_module

    def import_module(name: str) -> Any:
        if name.startswith("benchmarks"):
            raise ModuleNotFoundError(f"No module named {name!r}", name="benchmarks")
        return real(name)

    monkeypatch.setattr(cli, "importlib", SimpleNamespace(import_module=import_module))
    every = build_parser()
    assert set(COMMANDS) <= set(every._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as done:
        build_parser("bench")
    assert done.value.code == 2
