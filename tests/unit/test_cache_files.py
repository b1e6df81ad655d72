"""Cached files made once across processes (services/common/cache_files.py): two processes
asking for the same entry of an empty cache at once both get it whole and it is made once; a
reader never sees a file half-written; a running program is replaced, not rewritten.

The makers are slowed so that, without the lock, both processes would be making at the same
time."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from services.common import cache_files
from tests.unit.spawned import PROCESS_TIMEOUT_S, record_call, run_together

MAKER_DELAY_S = 0.5
CHUNKS = 64
CHUNK = b"x" * 65536


def slow_file(calls: Path, index: int) -> Callable[[Path], None]:
    def make(partial: Path) -> None:
        record_call(calls, index)
        with partial.open("wb") as out:
            for _ in range(CHUNKS):
                out.write(CHUNK)
                out.flush()
                time.sleep(MAKER_DELAY_S / CHUNKS)

    return make


def make_file_in_process(barrier: Barrier, index: int, path: Path, calls: Path) -> None:
    barrier.wait()
    made = cache_files.make_once(path, slow_file(calls, index))
    assert made.read_bytes() == CHUNK * CHUNKS


def make_directory_in_process(barrier: Barrier, index: int, path: Path, calls: Path) -> None:
    def make(partial: Path) -> None:
        record_call(calls, index)
        partial.mkdir()
        for i in range(8):
            (partial / f"part-{i}").write_text(str(i))
            time.sleep(MAKER_DELAY_S / 8)

    barrier.wait()
    made = cache_files.make_once(path, make)
    assert sorted(p.name for p in made.iterdir()) == [f"part-{i}" for i in range(8)]


def test_two_processes_make_a_file_once_and_both_read_it_whole(tmp_path: Path) -> None:
    path, calls = tmp_path / "cache" / "payload.bin", tmp_path / "calls"
    run_together(make_file_in_process, path, calls)
    assert len(calls.read_text().split()) == 1
    assert path.read_bytes() == CHUNK * CHUNKS
    assert sorted(p.name for p in path.parent.iterdir()) == ["payload.bin", "payload.bin.lock"]


def test_two_processes_make_a_directory_once_and_both_see_all_of_it(tmp_path: Path) -> None:
    path, calls = tmp_path / "cache" / "model", tmp_path / "calls"
    run_together(make_directory_in_process, path, calls)
    assert len(calls.read_text().split()) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["model", "model.lock"]


def write_versions(path: Path, versions: int) -> None:
    for version in range(versions):
        cache_files.write_text(path, json.dumps({"version": version, "pad": "y" * 200_000}))


def test_a_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "timings.json"
    versions = 200
    context = multiprocessing.get_context("spawn")
    writer = context.Process(target=write_versions, args=(path, versions))
    writer.start()
    seen: set[int] = set()
    try:
        while writer.is_alive() or not seen:
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            seen.add(json.loads(text)["version"])  # raises on a partial file
    finally:
        writer.join(PROCESS_TIMEOUT_S)
    assert writer.exitcode == 0
    assert json.loads(path.read_text())["version"] == versions - 1
    assert len(seen) > 1  # the reader did read while the writer wrote
    assert [p.name for p in tmp_path.iterdir()] == ["timings.json"]


def test_a_waiter_is_told_and_then_holds_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "shape"
    told, held = threading.Event(), threading.Event()

    def wait_for_it() -> None:
        with cache_files.locked(path, on_wait=told.set):
            held.set()

    with cache_files.locked(path):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        assert told.wait(PROCESS_TIMEOUT_S)
        assert not held.wait(0.2)  # flock: a second open of the lock file waits, even here
    waiter.join(PROCESS_TIMEOUT_S)
    assert held.is_set()
    with cache_files.locked(path, on_wait=lambda: pytest.fail("nobody holds it")):
        pass


def test_a_file_appears_only_whole(tmp_path: Path) -> None:
    out = tmp_path / "m.Q4_K_M.gguf"
    with pytest.raises(RuntimeError), cache_files.staged(out) as partial:
        partial.write_bytes(b"half")
        raise RuntimeError("the quantizer died")
    assert list(tmp_path.iterdir()) == []
    with cache_files.staged(out) as partial:
        assert not out.exists()
        partial.write_bytes(b"whole")
    assert out.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [out]


def test_a_failed_make_leaves_nothing_and_the_next_call_makes_it(tmp_path: Path) -> None:
    path = tmp_path / "tool"

    def fail(partial: Path) -> None:
        partial.write_text("half")
        raise RuntimeError("the build broke")

    with pytest.raises(RuntimeError, match="the build broke"):
        cache_files.make_once(path, fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tool.lock"]
    # A maker killed midway leaves its temporary name behind; the next maker clears it.
    leftover = cache_files.temporary_name(path)
    leftover.mkdir()
    cache_files.make_once(path, lambda partial: partial.write_text("whole"))
    assert path.read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tool", "tool.lock"]


def test_a_maker_that_writes_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        cache_files.make_once(tmp_path / "empty", lambda partial: None)
    assert not (tmp_path / "empty").exists()


def test_installing_over_a_running_program_replaces_it(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    tool = cache_files.install_file(Path(sleep), tmp_path / "bin" / "tool")
    running = subprocess.Popen([str(tool), "30"])
    try:
        time.sleep(0.2)
        # What the build did before: copying onto the file a process runs.
        with pytest.raises(OSError) as busy:
            shutil.copy2(sleep, tool)
        assert busy.value.errno == errno.ETXTBSY
        replacement = tmp_path / "new-tool"
        replacement.write_text("#!/bin/sh\necho new\n")
        replacement.chmod(0o755)
        cache_files.install_file(replacement, tool)
        assert running.poll() is None  # the running one keeps its file
        assert subprocess.run([str(tool)], capture_output=True, text=True).stdout == "new\n"
        assert os.access(tool, os.X_OK)
    finally:
        running.kill()
        running.wait()


def test_the_cache_root_is_one_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cache_files.CACHE_DIR_ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_files.cache_root() == tmp_path / "home" / ".cache" / "llmserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_files.cache_root() == tmp_path / "xdg" / "llmserve"
    monkeypatch.setenv(cache_files.CACHE_DIR_ENV_VAR, str(tmp_path / "mine"))
    assert cache_files.cache_root() == tmp_path / "mine"

    from benchmarks.llamacpp_build import cache_dir
    from benchmarks.model_shapes import shapes_dir
    from kernels.cpu_extension import extensions_root
    from services.worker.dtype_choice import cache_path
    from services.worker.step_graphs import default_inductor_cache_dir
    from tests.model.tiny_models import tiny_models_cache_dir

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("LLMSERVE_DTYPE_CACHE", raising=False)
    for path in (
        cache_dir(),
        extensions_root(),
        cache_path(),
        default_inductor_cache_dir(),
        tiny_models_cache_dir(),
        shapes_dir(),
    ):
        assert path.is_relative_to(tmp_path / "mine"), path
