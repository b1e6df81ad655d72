#!/usr/bin/env bash
# llmserve vs llama.cpp's OpenAI-compatible server (llama-cpp-python) on the same GGUF, the same
# cores and the same client (`llmserve bench serve`), one engine loaded at a time. Prints a
# side-by-side markdown table and writes JSON (services/bench/compare.py does the work).
#
# llama-cpp-python lives in its own venv, never in the project's dependencies. It ships as an
# sdist and compiles llama.cpp (several minutes on 2 cores). Created here when missing:
#   LLAMACPP_VENV=/work/llamacpp-venv scripts/bench_vs_llamacpp.sh
# Extra arguments go to compare.py (e.g. --concurrency 1,8 --output-len 64 --engines llamacpp).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMACPP_VENV=${LLAMACPP_VENV:-/work/llamacpp-venv}
if [ ! -x "$LLAMACPP_VENV/bin/python" ] || ! "$LLAMACPP_VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  echo "installing llama-cpp-python[server] into $LLAMACPP_VENV (compiles llama.cpp: minutes)" >&2
  python3 -m venv "$LLAMACPP_VENV"
  # A default CPU build: no CMAKE_ARGS (no CUDA/BLAS flags inherited from the environment).
  env -u CMAKE_ARGS "$LLAMACPP_VENV/bin/pip" install 'llama-cpp-python[server]'
fi
exec .venv/bin/python -m services.bench.compare --llamacpp-python "$LLAMACPP_VENV/bin/python" "$@"
