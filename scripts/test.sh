#!/usr/bin/env bash
# Run the whole test suite (lint, unit, kernels under the Triton interpreter, model parity
# against Hugging Face transformers, end-to-end). Sets up the machine first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# One worker per core (LLMSERVE_TEST_WORKERS overrides), each test file whole on one worker
# (its module fixtures built once); the 25 slowest tests are listed at the end.
WORKERS=${LLMSERVE_TEST_WORKERS:-$(nproc)}
.venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile --durations=25 "$@"
