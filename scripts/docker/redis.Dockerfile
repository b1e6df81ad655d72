# Redis for the compose stack where no registry serves redis:7-alpine: Debian's redis-server
# and redis-cli on the local base (scripts/docker/base_image.sh). The compose file's command,
# password recipe and health check run unchanged (sh, redis-server -, redis-cli).
ARG BASE_IMAGE=llmserve-base:local
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/*
USER redis
WORKDIR /var/lib/redis
