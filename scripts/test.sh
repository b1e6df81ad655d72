#!/usr/bin/env bash
# Run the whole test suite (lint, unit, kernels under the Triton interpreter, model parity
# against Hugging Face transformers, end-to-end). Sets up the machine first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
