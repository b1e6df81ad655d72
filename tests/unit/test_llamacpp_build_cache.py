"""llama.cpp's sources and tools in an empty cache, asked for by two test workers at once
(benchmarks/llamacpp_build.py): unpacked once and seen whole by both, built once, and a tool
installed while another process runs it. A small fake sdist stands in for PyPI's and a shell
script for the build (no network, no compiler)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from benchmarks import llamacpp_build
from services.common import cache_files
from tests.unit.spawned import record_call, run_together

DELAY_S = 0.5
FAKE_SOURCE_FILES = {
    "CMakeLists.txt": "project(llama.cpp)\n",
    "src/llama-vocab.cpp": "// the vocabulary\n" * 1000,
    **{f"models/ggml-vocab-{name}.gguf": name * 10000 for name in ("gpt-2", "llama-bpe", "qwen2")},
}
# What the fake build puts in build/bin: real programs (a script would be read by the shell,
# not executed, and could be overwritten while it runs). The first build's tool sleeps, a
# rebuild's returns at once.
FIRST_BUILD, REBUILD = shutil.which("sleep"), shutil.which("true")


def write_fake_sdist(root: Path) -> None:
    version = llamacpp_build.LLAMA_CPP_PYTHON_VERSION
    archive = root / "download" / f"llama_cpp_python-{version}.tar.gz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in FAKE_SOURCE_FILES.items():
            data = text.encode()
            member = tarfile.TarInfo(f"llama_cpp_python-{version}/vendor/llama.cpp/{name}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def source_files(source: Path) -> dict[str, str]:
    return {
        str(path.relative_to(source)): path.read_text()
        for path in sorted(source.rglob("*"))
        if path.is_file()
    }


def fake_build(calls: Path, index: int) -> None:
    """Stand-ins for the toolchain and cmake/ninja: the build records itself, takes a while
    and writes each target as a script."""
    builds = 0

    def run_logged(
        command: list[str], log_path: Path, description: str, show_progress: bool = True
    ) -> None:
        nonlocal builds
        if description != "llama.cpp build":
            return
        builds += 1
        record_call(calls, index)
        time.sleep(DELAY_S)
        build = Path(command[command.index("-C") + 1])
        targets = command[command.index("-j") + 2 :]
        (build / "bin").mkdir(parents=True, exist_ok=True)
        program = FIRST_BUILD if builds == 1 else REBUILD
        assert program is not None
        for name in targets:
            shutil.copy2(program, build / "bin" / name)

    toolchain = llamacpp_build.Toolchain("cmake", "ninja", "cc", "c++")
    llamacpp_build.find_toolchain = lambda: toolchain
    llamacpp_build.run_logged = run_logged  # type: ignore[assignment]


def ensure_source_in_process(barrier: Barrier, index: int, calls: Path) -> None:
    unpack = llamacpp_build.unpack_sdist

    def slow_unpack(
        archive: Path, into: Path, version: str = llamacpp_build.LLAMA_CPP_PYTHON_VERSION
    ) -> None:
        record_call(calls, index)
        time.sleep(DELAY_S)
        unpack(archive, into, version)

    llamacpp_build.unpack_sdist = slow_unpack
    barrier.wait()
    source = llamacpp_build.ensure_source()
    assert source_files(source) == FAKE_SOURCE_FILES


def test_two_workers_unpack_the_sources_once_and_both_see_them_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache_files.CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    root = llamacpp_build.cache_dir()
    write_fake_sdist(root)
    calls = tmp_path / "calls"
    run_together(ensure_source_in_process, calls)
    assert len(calls.read_text().split()) == 1
    package = f"llama_cpp_python-{llamacpp_build.LLAMA_CPP_PYTHON_VERSION}"
    assert sorted(p.name for p in (root / "src").iterdir()) == [package, f"{package}.lock"]


def build_quantize_in_process(barrier: Barrier, index: int, calls: Path) -> None:
    fake_build(calls, index)
    barrier.wait()
    tool = llamacpp_build.ensure_tools(["llama-quantize"]).quantize
    assert subprocess.run([str(tool), "0"], check=False).returncode == 0


def test_two_workers_build_a_tool_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache_files.CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    write_fake_sdist(llamacpp_build.cache_dir())
    calls = tmp_path / "calls"
    run_together(build_quantize_in_process, calls)
    assert len(calls.read_text().split()) == 1


def test_a_rebuild_installs_a_tool_another_process_is_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache_files.CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    write_fake_sdist(llamacpp_build.cache_dir())
    monkeypatch.setattr(llamacpp_build, "find_toolchain", llamacpp_build.find_toolchain)
    monkeypatch.setattr(llamacpp_build, "run_logged", llamacpp_build.run_logged)
    fake_build(tmp_path / "calls", 0)
    tool = llamacpp_build.ensure_tools(["llama-quantize"]).quantize
    running = subprocess.Popen([str(tool), "30"])
    try:
        time.sleep(0.2)
        # Before, the build copied onto this file: "Text file busy".
        rebuilt = llamacpp_build.ensure_tools(["llama-quantize"], force=True).quantize
        assert running.poll() is None  # the running one keeps its file
        # The rebuild's tool (`true`) answers at once where the first (`sleep`) would not.
        assert subprocess.run([str(rebuilt), "30"], timeout=10, check=False).returncode == 0
    finally:
        running.kill()
        running.wait()
    assert llamacpp_build.build_info()["llama_cpp_python"] == "0.3.36"
