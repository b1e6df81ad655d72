#!/usr/bin/env bash
# Regenerate the Python code for protos/llmserve/v1/*.proto, in place (checked in; a test
# fails when it is stale). Needs grpcio-tools (a test extra).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
  protos/llmserve/v1/sampling.proto protos/llmserve/v1/model.proto protos/llmserve/v1/logprobs.proto protos/llmserve/v1/lora.proto \
  protos/llmserve/v1/text.proto \
  protos/llmserve/v1/scheduler.proto protos/llmserve/v1/worker.proto
