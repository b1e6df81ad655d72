#!/usr/bin/env bash
# The decode step in containers vs on the host, one run: starts the compose stack (the images
# scripts/compose_check.sh built, host networking on loopback), then scripts/docker/
# decode_compare.py starts `llmserve up` beside it and gives both the same greedy requests in
# turns, and prints the table (target: the container's TPOT within 10 % of the host's). Run it
# on a quiet machine: it is a benchmark. Extra arguments go to decode_compare.py
# (--rounds 6 --concurrency 1 --input-len 128 --output-len 128 --host-flags "...").
set -euo pipefail
cd "$(dirname "$0")/.."

cannot_run() { echo "decode comparison cannot run here: $*"; exit 77; }
# shellcheck source=scripts/docker/engine.sh
source scripts/docker/engine.sh
PYTHON=${LLMSERVE_CHECK_PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || { echo "needs the project's virtualenv (scripts/setup.sh), or LLMSERVE_CHECK_PYTHON" >&2; exit 1; }
WORK=$(mktemp -d /tmp/llmserve-decode-compare.XXXXXX)
COMPOSE=(docker compose -p llmserve-compare --env-file "$WORK/env" -f docker-compose.yml -f docker-compose.host.yml)
cleanup() {
  local status=$?
  [ -f "$WORK/env" ] && "${COMPOSE[@]}" down --remove-orphans --timeout 20 >/dev/null 2>&1 || true
  stop_engine
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT

ensure_engine "$WORK"
for image in llmserve:latest llmserve-redis:local; do
  docker image inspect "$image" >/dev/null 2>&1 \
    || { echo "no image $image: run scripts/compose_check.sh first (it builds them)" >&2; exit 1; }
done
printf 'LLMSERVE_INTERNAL_SECRET=%s\nLLMSERVE_REDIS_PASSWORD=%s\nLLMSERVE_REDIS_IMAGE=llmserve-redis:local\n' \
  "$(python3 -c 'import secrets; print(secrets.token_hex(32))')" \
  "$(python3 -c 'import secrets; print(secrets.token_hex(32))')" >"$WORK/env"
echo "docker compose up (host networking, loopback ports) ..." >&2
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 900 >"$WORK/up.log" 2>&1 \
  || { cat "$WORK/up.log" >&2; exit 1; }
PYTHONPATH=. "$PYTHON" scripts/docker/decode_compare.py --compose 127.0.0.1:50151 "$@"
