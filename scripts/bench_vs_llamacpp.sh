#!/usr/bin/env bash
# llmserve vs llama.cpp's own C++ tools (llama-server, llama-bench, llama-batched-bench) on the
# same GGUF files and cores, one system loaded at a time: `llmserve bench peers`, which builds
# llama.cpp into $LLMSERVE_CACHE_DIR/peers on first use (~10 minutes on 2 cores) and prints one
# markdown table. Arguments go to it, e.g. --workloads a,b --engines llamacpp-q4_0,llmserve.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m services.cli bench peers "$@"
