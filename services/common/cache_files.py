"""llmserve's on-disk caches: where they live, and how a cached file or directory is made once
by many processes at a time (test workers, a worker and a benchmark, two checkouts).

    LLMSERVE_CACHE_DIR  (default ${XDG_CACHE_HOME:-~/.cache}/llmserve)
      peers/llama.cpp-<version>/   llama.cpp's sources and tools (benchmarks/llamacpp_build.py)
      tiny-models/v<n>/            the tests' tiny random models and their GGUF files
      shapes/                      real-size random models (benchmarks/model_shapes.py)
      torch_extensions/            the C++ CPU kernels (kernels/cpu_extension.py)
      inductor/                    compiled step graphs (services/worker/step_graphs.py)
      cpu-dtype.json               `--dtype auto`'s timings (services/worker/dtype_choice.py)

A path is made under an exclusive lock on `<path>.lock` beside it, written under a temporary
name in the same directory and renamed into place: another process sees it whole or not at
all, and a program being run is replaced by a new file, never rewritten in place (which Linux
refuses with "Text file busy").
"""

from __future__ import annotations

import fcntl
import glob
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_DIR_ENV_VAR = "LLMSERVE_CACHE_DIR"
TEMPORARY_SUFFIX = ".tmp"


def cache_root() -> Path:
    """LLMSERVE_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/llmserve (read at each call, so a
    test or a process can point it elsewhere)."""
    explicit = os.environ.get(CACHE_DIR_ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmserve"


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextmanager
def locked(path: Path, on_wait: Callable[[], object] | None = None) -> Iterator[None]:
    """Hold the exclusive lock of `path` (a `<path>.lock` file, created with its directory)
    until the block ends; `on_wait` is called first when another process holds it. The kernel
    drops a lock when its process dies, so a killed build leaves none to wait on."""
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def temporary_name(path: Path) -> Path:
    """A name beside `path`, unique to this call: `.<name>.<pid>.<random>.tmp`."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")


def remove(path: Path) -> None:
    """Remove a file, a link or a directory tree; nothing when absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def staged(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` to write a file or a directory to (nothing is created
    there); renamed onto `path` when the block ends, removed when it raises. A file replaces
    an existing `path`; a directory may only replace an empty one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        yield temporary
        if not temporary.exists() and not temporary.is_symlink():
            raise FileNotFoundError(f"nothing was written for {path} (to {temporary})")
        os.replace(temporary, path)
    finally:
        remove(temporary)


def make_once(path: Path, make: Callable[[Path], object]) -> Path:
    """`path`, made by `make(temporary)` when it does not exist yet: under `path`'s lock, so
    one process makes it while the others wait and then find it, and renamed into place whole.
    Every writer of `path` goes through here, so the leftovers of a killed maker (temporary
    names of `path`) are removed before making it again."""
    if path.exists():
        return path
    with locked(path):
        if not path.exists():
            for leftover in path.parent.glob(f".{glob.escape(path.name)}.*{TEMPORARY_SUFFIX}"):
                remove(leftover)
            with staged(path) as temporary:
                make(temporary)
    return path


def install_file(source: Path, destination: Path) -> Path:
    """Copy `source` (with its mode) to `destination` as a new file renamed into place: a
    process running the old one keeps it, the next one starts the new one."""
    with staged(destination) as temporary:
        shutil.copy2(source, temporary)
    return destination


def write_text(path: Path, text: str) -> Path:
    """`text` written to `path` whole (a reader finds the old text or the new, never part)."""
    with staged(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return path
