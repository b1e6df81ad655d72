"""llama.cpp's own tools, built from source for `llmserve bench peers`: `llama-server`,
`llama-bench`, `llama-batched-bench` and `llama-quantize`, from the llama.cpp that the
llama-cpp-python sdist vendors (PyPI is reachable where GitHub may not be).

    python -m benchmarks.llamacpp_build            # build once (~10 min on 2 cores)
    python -m benchmarks.llamacpp_build --force    # rebuild

Everything lives in the cache (LLMSERVE_CACHE_DIR), never in the repository:

    ${LLMSERVE_CACHE_DIR:-~/.cache/llmserve}/peers/llama.cpp-0.3.36/
      src/llama_cpp_python-0.3.36/vendor/llama.cpp/   unpacked sources
      build/                                           cmake + ninja tree (kept: a rebuild is
                                                       incremental)
      bin/llama-server ...                             the four binaries (static)
      build-info.json                                  version, llama.cpp commit, cmake flags
      build.log                                        the whole build output
      SmolLM2-135M-Instruct.Q4_0.gguf                  the Q4_0 requant of the embedded file

Each part is made once by one process while the others wait (test workers, a bench and a
test run at the same time), and appears whole (services/common/cache_files.py): the sources
are unpacked beside src/ and renamed in, a tool is installed as a new file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm  # type: ignore[import-untyped]

from services.common import cache_files

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize")
NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
LOG_TAIL_LINES = 40


class PeerBuildError(RuntimeError):
    """The peer could not be built or prepared; the message says what to install or read."""


@dataclass(frozen=True, slots=True)
class PeerBinaries:
    """Paths of the built tools."""

    bin_dir: Path

    def tool(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def server(self) -> Path:
        return self.tool("llama-server")

    @property
    def bench(self) -> Path:
        return self.tool("llama-bench")

    @property
    def batched_bench(self) -> Path:
        return self.tool("llama-batched-bench")

    @property
    def quantize(self) -> Path:
        return self.tool("llama-quantize")

    def missing(self) -> list[str]:
        return [name for name in TOOLS if not os.access(self.tool(name), os.X_OK)]


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_files.cache_root() / "peers" / f"llama.cpp-{version}"


def converter_env(source: Path) -> dict[str, str]:
    """The sources' gguf-py first (the converter may write keys newer than the installed
    package); nothing may reach a model hub."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(source / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def find_tool(*names: str) -> str | None:
    """The first of `names` on PATH or beside this interpreter (ninja from pip lives in the
    virtualenv's bin, which is not on PATH when the venv is not activated)."""
    for name in names:
        found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
        if found:
            return found
    return None


@dataclass(frozen=True, slots=True)
class Toolchain:
    cmake: str
    ninja: str
    c_compiler: str
    cxx_compiler: str


def find_toolchain() -> Toolchain:
    cmake = find_tool("cmake")
    ninja = find_tool("ninja")
    c_compiler = find_tool(os.environ.get("CC", ""), "cc", "gcc", "clang")
    cxx_compiler = find_tool(os.environ.get("CXX", ""), "c++", "g++", "clang++")
    missing = [
        hint
        for found, hint in (
            (cmake, "cmake >= 3.14 (apt-get install cmake, or pip install cmake)"),
            (ninja, "ninja (pip install ninja, or apt-get install ninja-build)"),
            (c_compiler, "a C compiler (apt-get install gcc)"),
            (cxx_compiler, "a C++17 compiler (apt-get install g++)"),
        )
        if not found
    ]
    if missing:
        raise PeerBuildError("building llama.cpp needs " + "; ".join(missing))
    assert cmake and ninja and c_compiler and cxx_compiler
    return Toolchain(cmake, ninja, c_compiler, cxx_compiler)


def cmake_flags() -> list[str]:
    """A CPU Release build tuned for this machine (-march=native), static so the copied
    binaries need no libllama.so beside them. No network at build time: no prebuilt web UI
    download, no OpenSSL (the server is only reached over loopback HTTP)."""
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]


def configure_command(toolchain: Toolchain, source: Path, build: Path) -> list[str]:
    return [
        toolchain.cmake,
        "-S",
        str(source),
        "-B",
        str(build),
        "-G",
        "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={toolchain.ninja}",
        f"-DCMAKE_C_COMPILER={toolchain.c_compiler}",
        f"-DCMAKE_CXX_COMPILER={toolchain.cxx_compiler}",
        *cmake_flags(),
    ]


def build_command(
    toolchain: Toolchain, build: Path, jobs: int, targets: Sequence[str] = TOOLS
) -> list[str]:
    # ninja itself, not `cmake --build`, so its "[n/total]" lines reach us unbuffered.
    return [toolchain.ninja, "-C", str(build), "-j", str(jobs), *targets]


def download_command(version: str, dest: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-binary",
        ":all:",
        "--no-deps",
        f"llama-cpp-python=={version}",
        "-d",
        str(dest),
    ]


def ninja_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja status line like '[12/345] Building CXX object ...'."""
    match = NINJA_PROGRESS.match(line)
    return (int(match.group(1)), int(match.group(2))) if match else None


def run_logged(
    command: Sequence[str], log_path: Path, description: str, show_progress: bool = True
) -> None:
    """Run `command`, appending its output to `log_path`; ninja's status lines drive a bar.
    On failure, the error names the log and shows its tail."""
    tail: list[str] = []
    bar: tqdm | None = None
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, "NINJA_STATUS": "[%f/%t] "},
        )
        assert process.stdout is not None
        try:
            for line in process.stdout:
                log.write(line)
                tail = [*tail[-LOG_TAIL_LINES + 1 :], line.rstrip("\n")]
                progress = ninja_progress(line)
                if progress is not None and show_progress:
                    if bar is None:
                        bar = tqdm(total=progress[1], desc=description, file=sys.stderr)
                    bar.total = progress[1]
                    bar.n = progress[0]
                    bar.refresh()
            code = process.wait()
        finally:
            if process.poll() is None:
                process.kill()
            if bar is not None:
                bar.close()
    if code != 0:
        shown = "\n".join(tail)
        raise PeerBuildError(f"{description} failed (exit {code}); full log: {log_path}\n{shown}")


def unpack_sdist(archive: Path, into: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> None:
    """Unpack the sdist's top directory as the directory `into` (which must not exist): into a
    temporary directory beside it, then renamed, so it appears whole."""
    with tempfile.TemporaryDirectory(dir=into.parent, prefix=".unpack-") as staging:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        unpacked = Path(staging) / f"llama_cpp_python-{version}"
        if not (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise PeerBuildError(f"no vendor/llama.cpp/CMakeLists.txt in {archive}")
        unpacked.rename(into)


def source_commit(source: Path) -> str | None:
    """The llama.cpp commit the sdist vendors (it ships the submodule's git metadata)."""
    try:
        result = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def download_sdist(version: str, archive: Path, log_path: Path) -> None:
    """pip's download of the sdist, written to `archive` (pip names its file itself, so it
    downloads into a temporary directory beside it)."""
    print(f"downloading llama-cpp-python {version} sdist from PyPI", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=archive.parent, prefix=".download-") as staging:
        run_logged(download_command(version, Path(staging)), log_path, "pip download")
        (Path(staging) / f"llama_cpp_python-{version}.tar.gz").rename(archive)


def ensure_source(
    root: Path | None = None, log_path: Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION
) -> Path:
    """llama.cpp's sources, vendored by the llama-cpp-python sdist: downloaded from PyPI and
    unpacked into `root` (default: the cache) once; returns their directory."""
    root = root or cache_dir(version)
    log_path = log_path or root / "download.log"
    package = root / "src" / f"llama_cpp_python-{version}"
    downloads = root / "download"
    archive = downloads / f"llama_cpp_python-{version}.tar.gz"

    def unpack(temporary: Path) -> None:
        cache_files.make_once(archive, lambda into: download_sdist(version, into, log_path))
        print(f"unpacking {archive.name}", file=sys.stderr)
        unpack_sdist(archive, temporary, version)

    cache_files.make_once(package, unpack)
    return package / "vendor" / "llama.cpp"


def ensure_built(
    force: bool = False, jobs: int | None = None, root: Path | None = None
) -> PeerBinaries:
    """The four tools, built on first use and reused after (a rebuild only with `force`)."""
    return ensure_tools(TOOLS, force=force, jobs=jobs, root=root)


def ensure_tools(
    names: Sequence[str],
    force: bool = False,
    jobs: int | None = None,
    root: Path | None = None,
) -> PeerBinaries:
    """Only the tools in `names` (ninja targets), built on first use into the shared cache and
    reused after. Building `llama-quantize` alone compiles ggml and libllama but not the server,
    a few minutes less on 2 cores; a later full build reuses those objects."""
    root = root or cache_dir()
    binaries = PeerBinaries(root / "bin")
    if not force and not [name for name in names if name in binaries.missing()]:
        return binaries
    toolchain = find_toolchain()
    build = root / "build"
    # One build at a time in the shared tree; who waited finds the tools built.
    with cache_files.locked(build):
        if not force and not [name for name in names if name in binaries.missing()]:
            return binaries
        log_path = root / "build.log"
        log_path.write_text("")
        source = ensure_source(root, log_path, LLAMA_CPP_PYTHON_VERSION)
        jobs = jobs or os.cpu_count() or 1
        print(
            f"building {', '.join(names)} in {build} ({jobs} jobs; log {log_path})",
            file=sys.stderr,
        )
        run_logged(configure_command(toolchain, source, build), log_path, "cmake configure")
        run_logged(build_command(toolchain, build, jobs, names), log_path, "llama.cpp build")
        for name in names:
            built = build / "bin" / name
            if not built.is_file():
                raise PeerBuildError(f"the build finished without {built}; see {log_path}")
            # A new file renamed in: a process running the old one keeps it.
            cache_files.install_file(built, binaries.tool(name))
        info = {
            "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
            "llama_cpp_commit": source_commit(source),
            "cmake_flags": cmake_flags(),
            "c_compiler": toolchain.c_compiler,
            "cxx_compiler": toolchain.cxx_compiler,
        }
        cache_files.write_text(root / "build-info.json", json.dumps(info, indent=1) + "\n")
    print(f"built into {binaries.bin_dir}", file=sys.stderr)
    return binaries


def build_info(root: Path | None = None) -> dict[str, object]:
    path = (root or cache_dir()) / "build-info.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def requant_name(source: Path, quant: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct.Q4_0.gguf' (the last
    dotted part of the stem is the quant type, as in the usual GGUF file names)."""
    stem, dot, last = source.stem.rpartition(".")
    base = stem if dot and re.fullmatch(r"(?i)(q\d.*|f16|f32|bf16|iq.*)", last) else source.stem
    return f"{base}.{quant}.gguf"


def quantize_command(binaries: PeerBinaries, source: Path, out: Path, quant: str) -> list[str]:
    # --allow-requantize: the source is already quantized (Q4_1), so this is Q4_1 -> float ->
    # Q4_0 per tensor; the values differ slightly from a Q4_0 made from the original weights.
    return [str(binaries.quantize), "--allow-requantize", str(source), str(out), quant]


def ensure_requant(
    binaries: PeerBinaries, source: Path, quant: str = "Q4_0", root: Path | None = None
) -> Path:
    """`source` requantized to `quant` in the cache, made once."""
    root = root or cache_dir()
    out = root / requant_name(source, quant)

    def requantize(partial: Path) -> None:
        print(f"requantizing {source.name} -> {out.name}", file=sys.stderr)
        run_logged(
            quantize_command(binaries, source, partial, quant),
            root / "quantize.log",
            "llama-quantize",
            show_progress=False,
        )

    return cache_files.make_once(out, requantize)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--jobs", type=int, default=None, help="build jobs (default: cores)")
    args = parser.parse_args(None if argv is None else list(argv))
    from services.common.model_source import embedded_model_path

    try:
        binaries = ensure_built(force=args.force, jobs=args.jobs)
        requant = ensure_requant(binaries, embedded_model_path())
    except PeerBuildError as exc:
        print(f"llamacpp_build: {exc}", file=sys.stderr)
        return 1
    for name in TOOLS:
        print(binaries.tool(name))
    print(requant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
