#!/usr/bin/env bash
# Set up, start the whole stack on the embedded model (worker, scheduler, tokenizer tier on
# 127.0.0.1:50051), stream one answer through the public gRPC API to show it works, then keep
# serving until Ctrl-C. Extra arguments go to `llmserve up` (e.g. --tokenizer-replicas 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p .llmserve
rm -f .llmserve/stack.json
.venv/bin/llmserve up --ready-file .llmserve/stack.json "$@" &
STACK=$!
trap 'kill -TERM $STACK 2>/dev/null; wait $STACK' INT TERM
while [ ! -f .llmserve/stack.json ]; do
  kill -0 $STACK 2>/dev/null || { echo "llmserve up failed" >&2; exit 1; }
  sleep 0.5
done
TARGET=$(.venv/bin/python -c "import json; print(json.load(open('.llmserve/stack.json'))['public'])")
.venv/bin/llmserve chat --target "$TARGET" "What is the capital of France? Answer in one sentence."
echo "llmserve is serving on $TARGET (Ctrl-C to stop). Try: .venv/bin/llmserve chat --target $TARGET \"Hello\"" >&2
wait $STACK
