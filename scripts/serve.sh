#!/usr/bin/env bash
# Set up, start the whole stack on the embedded model (worker, scheduler, tokenizer tier: gRPC
# on 127.0.0.1:50051, OpenAI-compatible HTTP on 127.0.0.1:8000), stream one answer through each
# door to show it works, then keep serving until Ctrl-C. Extra arguments go to `llmserve up`
# (e.g. --tokenizer-replicas 2).
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
HTTP=$(.venv/bin/python -c "import json; print(json.load(open('.llmserve/stack.json'))['http'] or '')")
.venv/bin/llmserve chat --target "$TARGET" "What is the capital of France? Answer in one sentence."
if [ -n "$HTTP" ] && [[ "$HTTP" == http://* ]] && command -v curl >/dev/null; then
  MODEL=$(curl -s "$HTTP/models" | .venv/bin/python -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
  echo "--- the same over HTTP: curl $HTTP/chat/completions ---" >&2
  curl -s "$HTTP/chat/completions" -H "Content-Type: application/json" -d "{\"model\": \"$MODEL\",
    \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one sentence.\"}],
    \"temperature\": 0, \"max_tokens\": 48}" \
    | .venv/bin/python -c "import json, sys; r = json.load(sys.stdin); print(r['choices'][0]['message']['content'] if 'choices' in r else r)"
  echo >&2
fi
echo "llmserve is serving on $TARGET (gRPC) and ${HTTP:-no HTTP} (Ctrl-C to stop). Try: .venv/bin/llmserve chat --target $TARGET \"Hello\"" >&2
wait $STACK
